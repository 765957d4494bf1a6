"""The backend table: every cp_backend the recipe accepts has one complete backend object."""

from __future__ import annotations

import importlib
import sys
from typing import get_args

import pytest

from cptune.config.loader import load_recipe
from cptune.config.parallelism import CpBackend as RecipeCpBackend
from cptune.parallel.backends.base import BatchSharder
from cptune.parallel.backends.deepspeed_ulysses.sharding import DeepSpeedUlyssesBackend
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.backends.ring_flash_attn.sharding import RingFlashAttnBackend
from cptune.parallel.backends.rows import KEY_GROUPS, NAMES, ROWS
from cptune.parallel.backends.spec import BackendPolicy, BackendRuntime
from cptune.parallel.backends.table import BACKENDS, LOCAL, backend_for, named_backend
from cptune.parallel.backends.torch_cp.sharding import TorchCpBackend


def members(protocol: type) -> set[str]:
    """The attributes and methods a protocol declares."""
    declared = set(protocol.__annotations__) | {
        name for name, value in vars(protocol).items() if callable(value)
    }
    return {name for name in declared if not name.startswith("_")}


def test_the_recipe_accepts_exactly_the_table_s_names():
    assert get_args(RecipeCpBackend) == NAMES == tuple(BACKENDS) == ("ring-flash-attn", "torch", "deepspeed")
    with pytest.raises(TypeError):
        BACKENDS["new"] = LOCAL  # type: ignore[index]  # the table is frozen


def test_each_row_is_a_package_with_its_name_keys_and_policy():
    from cptune.config.recipe import Recipe

    for row, group in zip(ROWS, KEY_GROUPS, strict=True):
        assert (
            BACKENDS[row.NAME].name == row.NAME
            and importlib.import_module(f"{row.__name__}.keys").KEYS is group
        )
        assert issubclass(Recipe, group)  # the recipe composes the backend's keys, top-level
        assert set(group.model_fields) <= set(Recipe.model_fields)


@pytest.mark.parametrize("backend", [*BACKENDS.values(), LOCAL], ids=lambda b: str(b.name))
def test_every_backend_implements_both_halves_of_the_spec(backend):
    runtime = backend.runtime()
    for protocol, implementation in ((BackendPolicy, backend), (BackendRuntime, runtime)):
        assert isinstance(implementation, protocol)
        for member in members(protocol):
            assert member in type(implementation).__dict__, (
                f"{type(implementation).__name__} does not define {member} itself"
            )
    assert backend.name is None or BACKENDS[backend.name] is backend


@pytest.mark.e2e
def test_the_policies_import_no_torch():
    """Validation reads every policy (rules, plan lines' inputs), so a recipe is checked before torch loads."""
    import subprocess

    code = (
        "import sys\n"
        "from cptune.parallel.backends.table import BACKENDS, LOCAL\n"
        "from cptune.config.loader import validate_recipe\n"
        "validate_recipe({'base_model': 'm', 'datasets': [{'path': 'd'}], 'context_parallel_size': 2})\n"
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate', 'deepspeed') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "sharder", [LocalBackend, RingFlashAttnBackend, TorchCpBackend, DeepSpeedUlyssesBackend]
)
def test_every_sharder_has_every_member(sharder):
    missing = [m for m in members(BatchSharder) if m != "attn_implementation" and not hasattr(sharder, m)]
    assert not missing


def test_context_parallel_size_1_runs_the_local_backend(write_recipe):
    recipe = load_recipe(write_recipe(cp_backend="torch"))
    assert backend_for(recipe) is LOCAL and named_backend(recipe) is BACKENDS["torch"]
    assert backend_for(recipe, 2) is BACKENDS["torch"]


def test_preflight_of_cp_backend_torch_does_not_import_ring_flash_attn(write_recipe, monkeypatch):
    """It once loaded ring-flash-attn for every cp > 1 that was not deepspeed."""
    from cptune.run.launch.preflight import preflight
    from cptune.run.plan import RunPlan

    monkeypatch.setitem(sys.modules, "ring_flash_attn", None)  # importing it now raises ImportError
    recipe = load_recipe(write_recipe(context_parallel_size=2, cp_backend="torch", sample_packing=False))
    preflight(RunPlan.build(recipe, 2), prepare_data=False)


def test_the_torch_backend_s_cpu_attention_patch_is_left_out_on_a_cuda_machine(write_recipe, monkeypatch):
    """The patch adds CPU SDPA handlers to torch's CP and is version-gated to the torch it was read in;
    on a GPU node torch has its own handlers, and planning it there refused other torch versions."""
    import torch

    from cptune.run.plan import RunPlan

    recipe = load_recipe(write_recipe(context_parallel_size=2, cp_backend="torch", sample_packing=False))
    name = "torch-cp-cpu-sdpa-handlers"
    assert name in {p.name for p in RunPlan.build(recipe, 2).patches.plan(recipe).selected}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = RunPlan.build(recipe, 2).patches.plan(recipe)
    assert name not in {p.name for p in plan.selected}
    (skipped,) = [s for s in plan.skipped if s.patch.name == name]
    assert skipped.why.endswith("on a machine without a CUDA GPU")
