"""The one table from ``cp_backend`` values to backend implementations.

A new backend is a package beside this module whose ``__init__`` implements
:class:`~cptune.parallel.backends.spec.CpBackend`, a member of
:class:`~cptune.parallel.backends.spec.CpBackendName`, and one row here.
Imports no torch (the recipe's validation reads the backends' rules through it).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from cptune.parallel.backends.deepspeed_ulysses import DEEPSPEED_ULYSSES
from cptune.parallel.backends.local import LOCAL
from cptune.parallel.backends.ring_flash_attn import RING_FLASH_ATTN
from cptune.parallel.backends.spec import CpBackend, CpBackendName
from cptune.parallel.backends.torch_cp import TORCH_CP

BACKENDS: MappingProxyType[CpBackendName, CpBackend] = MappingProxyType(
    {
        CpBackendName.RING_FLASH_ATTN: RING_FLASH_ATTN,
        CpBackendName.TORCH: TORCH_CP,
        CpBackendName.DEEPSPEED: DEEPSPEED_ULYSSES,
    }
)
"""Every ``cp_backend`` a recipe may name, in the order the docs list them."""


def named_backend(recipe: Any) -> CpBackend:
    """The backend the recipe's ``cp_backend`` names (whatever its context_parallel_size)."""
    return BACKENDS[CpBackendName(recipe.cp_backend)]


def backend_for(recipe: Any, cp_size: int | None = None) -> CpBackend:
    """The backend that runs the recipe at ``cp_size`` (default: its context_parallel_size): local at 1."""
    size = recipe.context_parallel_size if cp_size is None else cp_size
    return LOCAL if size <= 1 else named_backend(recipe)


__all__ = ["BACKENDS", "LOCAL", "CpBackend", "CpBackendName", "backend_for", "named_backend"]
