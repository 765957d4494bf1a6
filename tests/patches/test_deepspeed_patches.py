"""cp_backend: deepspeed's patches against the installed DeepSpeed, accelerate and transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cptune.parallel.backends.document_attention import DOCUMENT_ATTENTION_NAME
from cptune.parallel.backends.table import BACKENDS
from cptune.patches.core import ContextParallelWith, PatchSet
from cptune.patches.deepspeed_patches import (
    attention_registry_scope_patch,
    deepspeed_cpu_backend_patch,
    deepspeed_patches,
    skip_shm_op_build_patch,
    sp_attn_allows_cptune_patch,
)
from cptune.patches.registry import build_patches

DEEPSPEED = SimpleNamespace(context_parallel_size=2, cp_backend="deepspeed")
RING = SimpleNamespace(context_parallel_size=2, cp_backend="ring-flash-attn")
FOR_DEEPSPEED = ContextParallelWith(("deepspeed",))


def test_selected_for_deepspeed_only_and_fit_the_installed_libraries():
    pytest.importorskip("deepspeed")
    names = {p.name for p in deepspeed_patches(FOR_DEEPSPEED, DOCUMENT_ATTENTION_NAME)}
    assert names <= {p.name for p in build_patches(DEEPSPEED, BACKENDS.values())}
    plan = PatchSet(deepspeed_patches(FOR_DEEPSPEED, DOCUMENT_ATTENTION_NAME)).plan(DEEPSPEED)
    assert plan.ok, plan.describe()
    assert {p.name for p in plan.selected} == names
    assert not PatchSet(deepspeed_patches(FOR_DEEPSPEED, DOCUMENT_ATTENTION_NAME)).plan(RING).selected


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


def test_accelerate_accepts_cptune_core_attention_only_while_patched():
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    from cptune.parallel.backends.document_attention import DOCUMENT_ATTENTION_NAME

    with pytest.raises(ValueError, match="Invalid sp_attn_implementation"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation=DOCUMENT_ATTENTION_NAME)
    with PatchSet([sp_attn_allows_cptune_patch(FOR_DEEPSPEED, DOCUMENT_ATTENTION_NAME)]).applied(DEEPSPEED):
        config = DeepSpeedSequenceParallelConfig(sp_attn_implementation=DOCUMENT_ATTENTION_NAME)
        assert config.sp_attn_implementation == DOCUMENT_ATTENTION_NAME
        with pytest.raises(ValueError, match="not supported with sequence parallelism"):
            DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager")


def test_deepspeed_attention_wrapper_does_not_outlive_the_run():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def ulysses_wrapper(*args, **kwargs):  # what register_with_transformers installs
        raise AssertionError

    with PatchSet([attention_registry_scope_patch(FOR_DEEPSPEED)]).applied(DEEPSPEED):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = ulysses_wrapper  # deepspeed ulysses_sp.py:566
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
