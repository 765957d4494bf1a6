"""DeepSpeed's engine patches and cp_backend: deepspeed's own, against the installed DeepSpeed, accelerate and transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cptune.parallel.backends.deepspeed_ulysses.patches import attention_registry_scope_patch, ulysses_patches
from cptune.parallel.backends.table import BACKENDS
from cptune.patches.core import ContextParallelWith, PatchSet
from cptune.patches.deepspeed_patches import (
    OnDeepSpeedEngine,
    deepspeed_cpu_backend_patch,
    deepspeed_engine_patches,
    skip_shm_op_build_patch,
    zero0_grad_norm_patch,
)
from cptune.patches.registry import build_patches
from cptune.patches.zero_ring_patches import loader_shares_cp_batches_patch

DEEPSPEED = SimpleNamespace(context_parallel_size=2, cp_backend="deepspeed")
RING = SimpleNamespace(context_parallel_size=2, cp_backend="ring-flash-attn")
FOR_DEEPSPEED = ContextParallelWith(("deepspeed",))


def test_selected_for_deepspeed_only_and_fit_the_installed_libraries():
    pytest.importorskip("deepspeed")
    ours = [*deepspeed_engine_patches(FOR_DEEPSPEED), *ulysses_patches(FOR_DEEPSPEED)]
    names = {p.name for p in ours}
    plan = PatchSet(build_patches(BACKENDS[DEEPSPEED.cp_backend], BACKENDS.values())).plan(DEEPSPEED)
    assert plan.ok, plan.describe()
    # Ulysses trains on accelerate's cp mesh axis and shards its batches itself, as ring-flash-attn does.
    assert names | {
        "accelerate-deepspeed-loader-cp-batches",
        "accelerator-prepare-cp-by-backend",
        "trainer-cp-inputs-noop",
    } <= {p.name for p in plan.selected}
    assert not PatchSet(ours).plan(RING).selected
    assert (
        not {
            p.name
            for p in PatchSet(build_patches(BACKENDS[RING.cp_backend], BACKENDS.values())).plan(RING).selected
        }
        & names
    )


def test_deepspeed_on_cpu_gets_the_real_world_size(monkeypatch):
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if torch.cuda.is_available():
        pytest.skip("accelerate finds the GPU backend itself; the patch is for CPU-only machines")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    # accelerate/state.py:274 records num_processes=1 whenever this returns no backend.
    assert PartialState._prepare_backend(None, False, False, None) == (None, DistributedType.NO)
    with PatchSet([deepspeed_cpu_backend_patch(FOR_DEEPSPEED)]).applied(DEEPSPEED):
        assert PartialState._prepare_backend(None, False, False, None) == ("gloo", DistributedType.NO)
        # use_cpu runs (no DeepSpeed) and other launches keep accelerate's choice.
        assert PartialState._prepare_backend(None, True, False, None) == ("gloo", DistributedType.MULTI_CPU)
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
        assert PartialState._prepare_backend(None, False, False, None) == (None, DistributedType.NO)


def test_deepspeed_attention_wrapper_does_not_outlive_the_run():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def ulysses_wrapper(*args, **kwargs):  # what install_ulysses_attention puts in place
        raise AssertionError

    with PatchSet([attention_registry_scope_patch(FOR_DEEPSPEED)]).applied(DEEPSPEED):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = ulysses_wrapper  # as install_ulysses_attention does
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is ulysses_wrapper
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_shared_memory_op_is_not_built_on_cpu():
    pytest.importorskip("deepspeed")
    import importlib

    comm_torch = importlib.import_module("deepspeed.comm.torch")
    original = comm_torch.build_shm_op
    with PatchSet([skip_shm_op_build_patch(FOR_DEEPSPEED)]).applied(DEEPSPEED):
        assert comm_torch.build_shm_op() is None  # instead of a ~40 s g++ build
    assert comm_torch.build_shm_op is original


def test_zero0_gradient_norm_is_measured_before_the_engine_clips_steps_and_zeroes():
    """The engine steps a bare optimizer under ZeRO-0 in fp32 and reports no norm (engine.py:3519)."""
    import torch

    trained = torch.nn.Parameter(torch.zeros(3))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    trained.grad = torch.tensor([3.0, 4.0, 12.0])

    def take_model_step(engine, lr_kwargs):  # what the engine does: clip, step, zero the gradients
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0)
        engine.optimizer.step()
        engine.module.zero_grad(set_to_none=True)

    def engine(optimizer):
        return SimpleNamespace(
            module=torch.nn.ParameterList([trained, frozen]),
            optimizer=optimizer,
            torch_autocast_z0_gradscaler=None,
            _global_grad_norm=None,
        )

    bare = engine(torch.optim.SGD([trained], lr=0.1))
    zero0_grad_norm_patch(FOR_DEEPSPEED).replacement(take_model_step)(bare, None)
    assert (
        bare._global_grad_norm == 13.0 and trained.grad is None
    )  # the norm before clipping, of every gradient
    # Under ZeRO 1-3, fp16 and bf16 the optimizer wrapper's norm is the engine's; the wrapper leaves it alone.
    trained.grad = torch.ones(3)
    wrapped = engine(SimpleNamespace(_global_grad_norm=2.5, step=lambda: None))
    zero0_grad_norm_patch(FOR_DEEPSPEED).replacement(lambda engine, lr_kwargs: None)(wrapped, None)
    assert wrapped._global_grad_norm is None


# --- ring-flash-attn / torch CP under DeepSpeed's ZeRO ----------------------------------------------------


def _zero(backend: str, **keys: object) -> SimpleNamespace:
    return SimpleNamespace(
        **{"context_parallel_size": 2, "cp_backend": backend, "deepspeed": None, "zero_stage": None, **keys}
    )


def test_ring_and_torch_under_zero_get_the_engine_patches_and_the_loader_patch_not_ulysses_one():
    pytest.importorskip("deepspeed")
    for recipe in (_zero("ring-flash-attn", zero_stage=3), _zero("torch", deepspeed="zero2.json")):
        plan = PatchSet(build_patches(BACKENDS[recipe.cp_backend], BACKENDS.values())).plan(recipe)
        assert plan.ok, plan.describe()
        selected = {p.name for p in plan.selected}
        assert {
            "deepspeed-skip-cpu-shm-op",
            "accelerate-deepspeed-cpu-world-size",
            "accelerate-deepspeed-loader-cp-batches",
            "accelerator-prepare-cp-by-backend",  # accelerate's torch CP context stays off, as next to DDP
        } <= selected, recipe
        assert "attention-registry-run-scope" not in selected
    # DDP's loader already shares the batches, and at cp=1 no engine runs (the recipe rules refuse the keys there).
    at_cp1 = _zero("ring-flash-attn", zero_stage=3, context_parallel_size=1)
    for recipe in (_zero("ring-flash-attn"), _zero("torch"), at_cp1):
        selected = {
            p.name
            for p in PatchSet(build_patches(BACKENDS[recipe.cp_backend], BACKENDS.values()))
            .plan(recipe)
            .selected
        }
        assert "accelerate-deepspeed-loader-cp-batches" not in selected, recipe
    # The predicate the registry builds, as `cptune validate` prints it.
    assert str(OnDeepSpeedEngine(("deepspeed",), ("ring-flash-attn", "torch"))) == (
        "context_parallel_size > 1 and (cp_backend in (deepspeed), or cp_backend in (ring-flash-attn, torch) "
        "with deepspeed or zero_stage set)"
    )


class _Mesh:
    """The parts of a (dp_shard, cp) DeviceMesh accelerate's prepare_data_loader reads."""

    mesh_dim_names = ("dp_shard", "cp")

    def __getitem__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(size=lambda: 2)


def test_under_deepspeed_the_ranks_of_a_cp_group_load_the_same_batches(monkeypatch):
    """accelerate's DeepSpeed branch reads no cp axis (data_loader.py:1130): each rank got its own batches."""
    import accelerate.accelerator
    import accelerate.data_loader
    import accelerate.state
    from accelerate.utils import DistributedType
    from torch.utils.data import DataLoader

    state = SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED, num_processes=4, process_index=0, device="cpu"
    )
    for module in (accelerate.state, accelerate.data_loader):
        monkeypatch.setattr(module, "PartialState", lambda: state)

    def batches(rank: int) -> list[int]:
        loader = accelerate.accelerator.prepare_data_loader(
            DataLoader(list(range(8)), batch_size=1),
            num_processes=4,
            process_index=rank,
            put_on_device=False,
            torch_device_mesh=_Mesh(),
        )
        return [int(b) for b in loader]

    # Upstream: 4 data-parallel ranks, so the two ranks of CP group 1 (ranks 2, 3) split different rows.
    assert (batches(2), batches(3)) == ([2, 6], [3, 7])
    ring_zero = _zero("ring-flash-attn", zero_stage=3)
    with PatchSet([loader_shares_cp_batches_patch(OnDeepSpeedEngine((), ("ring-flash-attn",)))]).applied(
        ring_zero
    ):
        # Patched: 2 data-parallel groups; both ranks of a group get the group's batches, as without DeepSpeed.
        assert batches(2) == batches(3) == [1, 3, 5, 7]
        assert batches(0) == batches(1) == [0, 2, 4, 6]
