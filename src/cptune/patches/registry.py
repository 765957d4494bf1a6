"""The one list of patches cptune may apply.

Every patch cptune knows is built here, in a fixed order; each patch's own
predicate decides whether a recipe needs it, so ``cptune validate`` can show
what is applied and what is skipped. The patches that a recipe can need
together touch different targets, so their order does not change the result;
it only fixes the order of the log lines and of reverting. Two patches share
``AcceleratorState.__init__`` (CP without FSDP on GPUs, FSDP2 on CPUs); their
predicates exclude each other (``fsdp_version`` unset / set).
"""

from __future__ import annotations

from typing import Any

from cptune.patches.accelerate_patches import (
    accelerator_state_cp_without_fsdp_patch,
    accelerator_state_fsdp_on_cpu_patch,
    cp_context_guard_patch,
    prepare_cp_patch,
    validate_accelerator_multi_cpu_patch,
)
from cptune.patches.core import Patch, PatchSet
from cptune.patches.deepspeed_patches import deepspeed_patches
from cptune.patches.torch_patches import torch_cp_cpu_sdpa_patch
from cptune.patches.transformers_patches import ring_flash_attn_import_compat_patch, trainer_cp_inputs_patch


def build_patches(recipe: Any) -> list[Patch]:
    """All patches of a training run, bound to ``recipe``'s values where a wrapper needs them.

    Plan and apply the resulting set with the same recipe.
    """
    return [
        trainer_cp_inputs_patch(),
        prepare_cp_patch(recipe.cp_backend),
        cp_context_guard_patch(recipe.cp_backend),
        validate_accelerator_multi_cpu_patch(),
        accelerator_state_cp_without_fsdp_patch(),
        accelerator_state_fsdp_on_cpu_patch(),
        torch_cp_cpu_sdpa_patch(),
        *deepspeed_patches(),
    ]


def build_patch_set(recipe: Any) -> PatchSet:
    """The :class:`PatchSet` for a training run: ``with build_patch_set(r).applied(r): ...``."""
    return PatchSet(build_patches(recipe))


def ring_flash_attn_import_patch_set() -> PatchSet:
    """Patches needed only while ``ring_flash_attn`` is imported; apply them around the import alone.

    Kept apart from :func:`build_patch_set` because the value is copied into
    ring_flash_attn's namespace at import time, so there is no reason to leave
    it in transformers for the whole run.
    """
    return PatchSet([ring_flash_attn_import_compat_patch()])
