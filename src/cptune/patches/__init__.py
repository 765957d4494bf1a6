"""Checked, reversible patches of transformers and accelerate.

Importing this package patches nothing: a :class:`PatchSet` does, when asked,
and reverts what it did. See ``core`` for the mechanism and ``registry`` for
the list of patches.
"""

from cptune.patches.core import (
    MISSING,
    ContextParallelWith,
    Patch,
    PatchPlan,
    PatchProblem,
    PatchSet,
    SkippedPatch,
    Target,
    always,
)
from cptune.patches.registry import build_patch_set, build_patches, import_patch_set

__all__ = [
    "MISSING",
    "ContextParallelWith",
    "Patch",
    "PatchPlan",
    "PatchProblem",
    "PatchSet",
    "SkippedPatch",
    "Target",
    "always",
    "build_patch_set",
    "build_patches",
    "import_patch_set",
]
