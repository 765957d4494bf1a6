"""The real patches against the installed transformers/accelerate/ring-flash-attn.

These tests fail when an upgrade moves or reshapes a patched object, and they
show on CPU what each wrapper does. The GPU-only path of
``accelerator-state-cp-without-fsdp`` runs the real upstream ``__init__`` on a
faked MULTI_GPU ``PartialState``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cptune.errors import PatchError
from cptune.parallel.backends.table import BACKENDS
from cptune.patches import (
    MISSING,
    ContextParallelWith,
    Patch,
    PatchSet,
    Target,
    build_patch_set,
    import_patch_set,
)
from cptune.patches.accelerate_patches import (
    accelerator_state_cp_without_fsdp_patch,
    accelerator_state_fsdp_on_cpu_patch,
    cp_context_guard_patch,
    prepare_cp_patch,
    validate_accelerator_multi_cpu_patch,
)
from cptune.patches.transformers_patches import trainer_cp_inputs_patch

RING = SimpleNamespace(context_parallel_size=2, cp_backend="ring-flash-attn", is_fsdp=False)
TORCH = SimpleNamespace(context_parallel_size=2, cp_backend="torch", is_fsdp=False)
DEEPSPEED = SimpleNamespace(context_parallel_size=2, cp_backend="deepspeed", is_fsdp=False)
NO_CP = SimpleNamespace(context_parallel_size=1, cp_backend="ring-flash-attn", is_fsdp=False)
# The predicates the registry builds from the backend table.
SELF_SHARDING = ContextParallelWith(("ring-flash-attn", "torch"))
ON_DDP = ContextParallelWith(("ring-flash-attn", "torch"), plain_ddp=True)


def _raw(target: str):
    """The object stored in the target owner's own namespace (what revert must put back)."""
    parsed = Target.parse(target)
    owner = importlib.import_module(parsed.module)
    for part in parsed.path[:-1]:
        owner = getattr(owner, part)
    return vars(owner).get(parsed.path[-1], MISSING)


def _selected(recipe) -> list[str]:
    return [
        patch.name
        for patch in build_patch_set(BACKENDS[recipe.cp_backend], BACKENDS.values()).plan(recipe).selected
    ]


def test_ring_plan_matches_installed_versions():
    plan = build_patch_set(BACKENDS[RING.cp_backend], BACKENDS.values()).plan(RING)
    assert plan.ok, plan.describe()
    assert len(plan.selected) == 6
    assert "torch-cp-cpu-sdpa-handlers" in [skipped.patch.name for skipped in plan.skipped]


def test_torch_plan_matches_installed_versions():
    plan = build_patch_set(BACKENDS[TORCH.cp_backend], BACKENDS.values()).plan(TORCH)
    assert plan.ok, plan.describe()
    assert [patch.name for patch in plan.selected][-1] == "torch-cp-cpu-sdpa-handlers"
    assert len(plan.selected) == 7


def test_import_compat_plan_matches_installed_versions():
    assert import_patch_set(BACKENDS["ring-flash-attn"].runtime()).plan().ok


def test_selection_by_backend():
    everything = _selected(RING)
    assert _selected(TORCH) == [*everything, "torch-cp-cpu-sdpa-handlers"]
    # deepspeed shards its batches as ring-flash-attn does, on DeepSpeed's engine, with DeepSpeed's attention.
    assert _selected(DEEPSPEED) == [
        *everything,
        "deepspeed-skip-cpu-shm-op",
        "accelerate-deepspeed-cpu-world-size",
        "deepspeed-zero0-grad-norm",
        "accelerate-deepspeed-loader-cp-batches",
        "attention-registry-run-scope",
    ]
    # Every run's gloo groups get one worker thread (tests/patches/test_torch_patches.py); nothing else without CP.
    assert _selected(NO_CP) == ["gloo-one-worker-thread"]


def test_apply_then_revert_restores_identity():
    patch_set = build_patch_set(
        BACKENDS[TORCH.cp_backend], BACKENDS.values()
    )  # ring's patches and torch's CPU handlers
    before = {patch.target: _raw(patch.target) for patch in patch_set.plan(TORCH).selected}
    with patch_set.applied(TORCH):
        for target, original in before.items():
            assert _raw(target) is not original
        assert patch_set.plan(TORCH).ok  # re-planning while applied checks the originals
    for target, original in before.items():
        assert _raw(target) is original


def test_trainer_inputs_pass_through_with_null_context():
    from transformers.trainer import Trainer

    inputs = {"input_ids": torch.arange(8).view(1, 8), "labels": torch.arange(8).view(1, 8)}
    snapshot = {key: value.clone() for key, value in inputs.items()}
    trainer = SimpleNamespace(accelerator=None)  # the replacement must not look at the Trainer at all
    with PatchSet([trainer_cp_inputs_patch(SELF_SHARDING)]).applied(RING):
        context, returned = Trainer._prepare_context_parallel_inputs(trainer, torch.nn.Linear(2, 2), inputs)
    assert context is contextlib.nullcontext
    assert returned is inputs
    assert returned.keys() == snapshot.keys()
    assert all(torch.equal(returned[key], snapshot[key]) for key in snapshot)


def test_prepare_cp_for_ring_returns_args_and_adds_no_hooks(monkeypatch):
    import torch.distributed.tensor.experimental._attention as cp_attention
    from accelerate import Accelerator

    def forbidden(*args, **kwargs):
        raise AssertionError("set_rotate_method must not be called for ring-flash-attn")

    monkeypatch.setattr(cp_attention, "set_rotate_method", forbidden)
    model = torch.nn.Sequential()
    model.add_module("self_attn", torch.nn.Linear(2, 2))
    optimizer = object()
    accelerator = SimpleNamespace()  # no parallelism_config or mesh: the original would fail on it
    patches = PatchSet(
        [
            prepare_cp_patch(SELF_SHARDING, shards_itself=True),
            cp_context_guard_patch(SELF_SHARDING),
        ]
    )
    with patches.applied(RING):
        returned = Accelerator._prepare_cp(accelerator, model, optimizer)
        with pytest.raises(PatchError, match="maybe_context_parallel"):
            Accelerator._cp_context(accelerator, buffers=[], buffer_seq_dims=[], no_restore_buffers=set())
    assert returned == (model, optimizer)
    assert returned[0] is model and returned[1] is optimizer
    assert not model.self_attn._forward_pre_hooks
    # Nothing of the patch stays behind: not on the instance, not on the class.
    assert vars(accelerator) == {} and not hasattr(Accelerator, "_cp_context")


def test_prepare_cp_for_torch_checks_instead_of_dropping_masks(monkeypatch):
    import torch.distributed.tensor.experimental._attention as cp_attention
    from accelerate import Accelerator

    def forbidden(*args, **kwargs):
        raise AssertionError("the torch backend sets the rotate method per micro batch, not process-wide")

    monkeypatch.setattr(cp_attention, "set_rotate_method", forbidden)
    model = torch.nn.Sequential()
    model.add_module("self_attn", torch.nn.Linear(2, 2))
    accelerator = SimpleNamespace()
    with PatchSet(
        [
            prepare_cp_patch(SELF_SHARDING, shards_itself=True),
            cp_context_guard_patch(SELF_SHARDING, guard=BACKENDS["torch"].runtime().cp_context_guard),
        ]
    ).applied(TORCH):
        returned = Accelerator._prepare_cp(accelerator, model)
        with pytest.raises(PatchError, match="would shard the batch a second time"):
            Accelerator._cp_context(accelerator, buffers=[], buffer_seq_dims=[], no_restore_buffers=set())
    assert returned == (model,)
    # No accelerate hook that would replace the mask with is_causal=True; cptune's
    # torch backend checks every batch's documents itself (tests/parallel/backends/test_torch_cp.py).
    assert not model.self_attn._forward_pre_hooks
    assert vars(accelerator) == {} and not hasattr(Accelerator, "_cp_context")


def test_prepare_cp_for_other_backends_calls_original():
    calls = []

    def original(self, *args):
        calls.append((self, args))
        return args

    wrapper = prepare_cp_patch(SELF_SHARDING, shards_itself=False).replacement(original)
    assert wrapper("acc", 1, 2) == (1, 2)
    assert calls == [("acc", (1, 2))]


def _multi_cpu_accelerator(num_processes=2):
    from accelerate.utils import DistributedType

    return SimpleNamespace(
        distributed_type=DistributedType.MULTI_CPU,
        multi_device=False,  # accelerate's Accelerator.multi_device leaves MULTI_CPU out
        num_processes=num_processes,
        is_fsdp2=False,
        is_main_process=True,
    )


def test_validate_accelerator_accepts_multi_cpu_for_cp_only():
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match="MULTI_CPU"):  # upstream behaviour the patch exists for
        ParallelismConfig(cp_size=2)._validate_accelerator(_multi_cpu_accelerator())
    with PatchSet([validate_accelerator_multi_cpu_patch(ON_DDP)]).applied(RING):
        ParallelismConfig(cp_size=2)._validate_accelerator(_multi_cpu_accelerator())
        # The original's other checks still run.
        with pytest.raises(ValueError, match="does not match"):
            ParallelismConfig(cp_size=2)._validate_accelerator(_multi_cpu_accelerator(num_processes=4))
        # Not CP-only: the original decides, and rejects MULTI_CPU.
        with pytest.raises(ValueError, match="MULTI_CPU"):
            ParallelismConfig(tp_size=2)._validate_accelerator(_multi_cpu_accelerator())


@contextlib.contextmanager
def _fake_partial_state(distributed_type: str, backend: str):
    """Makes accelerate believe a 2-process PartialState of this type exists; restores the real state after."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    saved = dict(PartialState._shared_state), dict(AcceleratorState._shared_state)
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._shared_state.update(
        distributed_type=DistributedType(distributed_type),
        device=torch.device("cpu"),
        num_processes=2,
        process_index=0,
        local_process_index=0,
        backend=backend,
        debug=False,
        fork_launched=False,
    )
    try:
        yield AcceleratorState
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._shared_state.update(saved[0])
        AcceleratorState._shared_state.update(saved[1])


@pytest.fixture
def fake_multi_gpu_state():
    with _fake_partial_state("MULTI_GPU", "nccl") as state:
        yield state


@pytest.fixture
def fake_multi_cpu_state():
    with _fake_partial_state("MULTI_CPU", "gloo") as state:
        yield state


def _state_kwargs(**overrides):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DynamoBackend

    kwargs = {
        "dynamo_plugin": SimpleNamespace(backend=DynamoBackend.NO),
        "parallelism_config": ParallelismConfig(cp_size=2),
        "_from_accelerator": True,
    }
    return {**kwargs, **overrides}


def test_state_init_upstream_requires_fsdp_for_cp_on_gpu(fake_multi_gpu_state):
    with pytest.raises(ValueError, match="no `fsdp_plugin` was provided"):
        fake_multi_gpu_state(**_state_kwargs())


def test_state_init_upstream_standalone_escape_breaks_is_fsdp2(fake_multi_gpu_state, monkeypatch):
    monkeypatch.setenv(
        "ACCELERATE_ALLOW_CP_STANDALONE", "true"
    )  # what cptune avoids; shown to justify the patch
    state = fake_multi_gpu_state(**_state_kwargs())
    assert state.distributed_type == "FSDP" and state.fsdp_plugin is None
    with pytest.raises(AttributeError):
        _ = state.is_fsdp2


def test_state_init_patch_keeps_ddp_for_cp_on_gpu(fake_multi_gpu_state):
    kwargs = _state_kwargs()
    with PatchSet([accelerator_state_cp_without_fsdp_patch(ON_DDP)]).applied(RING):
        state = fake_multi_gpu_state(**kwargs)
    assert state.distributed_type == "MULTI_GPU"
    assert state.parallelism_config is kwargs["parallelism_config"]
    assert state.is_fsdp2 is False


def test_state_init_patch_leaves_fsdp_runs_alone(fake_multi_gpu_state):
    fsdp_plugin = SimpleNamespace(fsdp_version=2, set_mixed_precision=lambda precision: None)
    kwargs = _state_kwargs(fsdp_plugin=fsdp_plugin)
    with PatchSet([accelerator_state_cp_without_fsdp_patch(ON_DDP)]).applied(RING):
        state = fake_multi_gpu_state(**kwargs)
    assert state.distributed_type == "FSDP" and state.is_fsdp2 is True
    assert state.parallelism_config is kwargs["parallelism_config"]


FSDP_RING = SimpleNamespace(context_parallel_size=2, cp_backend="ring-flash-attn", is_fsdp=True)


def _fsdp_plugin():
    precisions = []
    plugin = SimpleNamespace(fsdp_version=2, set_mixed_precision=precisions.append)
    return plugin, precisions


def test_state_init_upstream_drops_the_fsdp_plugin_on_cpu(fake_multi_cpu_state):
    plugin, _ = _fsdp_plugin()
    state = fake_multi_cpu_state(**_state_kwargs(fsdp_plugin=plugin))
    assert state.distributed_type == "MULTI_CPU" and not state.is_fsdp2  # what the patch exists for


def test_state_init_patch_makes_cpu_runs_fsdp_with_the_plugin_and_precision(fake_multi_cpu_state):
    plugin, precisions = _fsdp_plugin()
    kwargs = _state_kwargs(fsdp_plugin=plugin, mixed_precision="bf16")
    with PatchSet([accelerator_state_fsdp_on_cpu_patch()]).applied(FSDP_RING):
        state = fake_multi_cpu_state(**kwargs)
    assert state.distributed_type == "FSDP" and state.is_fsdp2 is True
    assert state.fsdp_plugin is plugin and precisions == ["bf16"]
    assert state.parallelism_config is kwargs["parallelism_config"]


def test_state_init_fsdp_patch_changes_nothing_without_a_plugin(fake_multi_cpu_state):
    with PatchSet([accelerator_state_fsdp_on_cpu_patch()]).applied(FSDP_RING):
        state = fake_multi_cpu_state(**_state_kwargs())
    assert state.distributed_type == "MULTI_CPU"


def test_fsdp_recipes_get_the_fsdp_patch_and_not_the_plain_ddp_ones():
    selected = _selected(FSDP_RING)
    assert "accelerator-state-fsdp-on-cpu" in selected
    assert "accelerator-state-cp-without-fsdp" not in selected
    assert "parallelism-config-allow-multi-cpu" not in selected
    assert "accelerator-prepare-cp-by-backend" in selected
    assert "accelerator-state-fsdp-on-cpu" not in _selected(RING)
    assert build_patch_set(BACKENDS[FSDP_RING.cp_backend], BACKENDS.values()).plan(FSDP_RING).ok


@contextlib.contextmanager
def _isolated_ring_flash_attn_import():
    """Lets a test import ring_flash_attn afresh, then puts sys.modules back as it was."""
    saved = {name: module for name, module in sys.modules.items() if name.startswith("ring_flash_attn")}
    for name in saved:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [name for name in sys.modules if name.startswith("ring_flash_attn")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _flash_attn_stand_ins() -> list[Patch]:
    """sys.modules entries standing in for flash_attn: just the names ring_flash_attn imports."""

    def stub(name):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        for kind in ("", "varlen_"):
            for step in ("forward", "backward"):
                setattr(module, f"_flash_attn_{kind}{step}", None)
        return module

    return [
        Patch(
            name=f"stand-in-{name}",
            target=f"sys:modules[{name!r}]",
            replacement=lambda original, name=name: stub(name),
            reason="test stand-in for flash-attn",
            remove_when="never",
            create=True,
        )
        for name in ("flash_attn", "flash_attn.flash_attn_interface")
    ]


def test_import_compat_lets_ring_flash_attn_import():
    import transformers.modeling_flash_attention_utils as fa_utils

    flash_attn_before = sys.modules.get("flash_attn")
    with _isolated_ring_flash_attn_import(), PatchSet(_flash_attn_stand_ins()).applied():
        with pytest.raises(ImportError, match="is_flash_attn_greater_or_equal_2_10"):
            import ring_flash_attn
        with import_patch_set(BACKENDS["ring-flash-attn"].runtime()).applied():
            import ring_flash_attn

        assert ring_flash_attn.adapters.hf_adapter.is_flash_attn_greater_or_equal_2_10 is True
    assert not hasattr(fa_utils, "is_flash_attn_greater_or_equal_2_10")
    assert sys.modules.get("flash_attn") is flash_attn_before


_WORKER = """
import json, os, torch
from types import SimpleNamespace
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from cptune.patches.accelerate_patches import (
    accelerator_state_cp_without_fsdp_patch,
    accelerator_state_fsdp_on_cpu_patch, prepare_cp_patch, validate_accelerator_multi_cpu_patch)
from cptune.patches.core import ContextParallelWith, PatchSet

ON_DDP = ContextParallelWith(("ring-flash-attn", "torch"), plain_ddp=True)
SELF_SHARDING = ContextParallelWith(("ring-flash-attn", "torch"))
recipe = SimpleNamespace(context_parallel_size=2, cp_backend="ring-flash-attn")
patches = PatchSet([accelerator_state_cp_without_fsdp_patch(ON_DDP), prepare_cp_patch(SELF_SHARDING, shards_itself=True),
                    validate_accelerator_multi_cpu_patch(ON_DDP)])
with patches.applied(recipe):
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(cp_size=2))
    model = torch.nn.Sequential()
    model.add_module("self_attn", torch.nn.Linear(4, 4))
    # accelerator.prepare would also wrap the model in DDP (upstream, measured in the CPU notes), but
    # importing torch.distributed.tensor for it costs seconds; _prepare_cp is what cptune changes.
    returned = accelerator._prepare_cp(model)
    result = dict(
        distributed_type=str(accelerator.distributed_type.value),
        mesh=list(accelerator.torch_device_mesh.mesh_dim_names),
        same_model=returned[0] is model,
        hooks=len(model.self_attn._forward_pre_hooks),
    )
accelerator.end_training()
print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.mark.distributed
def test_two_cpu_processes_get_a_cp_mesh():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    src = str(Path(__file__).resolve().parents[2] / "src")
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _WORKER],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output
        result = json.loads(output.split("RESULT ", 1)[1])
        assert result == {
            "distributed_type": "MULTI_CPU",
            "mesh": ["cp"],
            "same_model": True,
            "hooks": 0,
        }


def test_tensor_parallel_recipes_pass_accelerates_prepare_tp_through():
    from accelerate import Accelerator

    tp = SimpleNamespace(**{**vars(FSDP_RING), "tensor_parallel_size": 2})
    assert "accelerate-prepare-tp-passthrough" in _selected(tp)
    assert "accelerate-prepare-tp-passthrough" not in _selected(FSDP_RING)
    patch_set = build_patch_set(BACKENDS[tp.cp_backend], BACKENDS.values())
    assert patch_set.plan(tp).ok
    model, optimizer = torch.nn.Linear(2, 2), object()
    with patch_set.applied(tp):
        # cptune split the model itself; FSDP2's preparation then prepares every object once.
        assert Accelerator._prepare_tp(SimpleNamespace(), model, optimizer) == (model, optimizer)
    # Why: under FSDP2 the original imports a class that transformers 5.23 no longer has.
    with pytest.raises(ImportError):
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
