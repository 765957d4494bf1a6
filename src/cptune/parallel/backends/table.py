"""The backend table: each ``cp_backend`` value's policy, and which backend runs a recipe.

The rows are :data:`cptune.parallel.backends.rows.ROWS` (a backend is its package and one row
there); each row's policy is its package's ``policy`` module's ``POLICY``, loaded by module name
so that a new backend needs no import here. Imports no torch (the recipe's rules read the
backends' through it).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING

from cptune.parallel.backends.local import policy as local
from cptune.parallel.backends.rows import ROWS

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.spec import BackendPolicy


def _policy(package: ModuleType) -> BackendPolicy:
    return importlib.import_module(f"{package.__name__}.policy").POLICY


BACKENDS: Mapping[str, BackendPolicy] = MappingProxyType({row.NAME: _policy(row) for row in ROWS})
"""``cp_backend`` value -> the backend's policy, frozen, in the order of the rows."""

LOCAL: BackendPolicy = local.POLICY
"""The backend of context_parallel_size 1, whatever ``cp_backend`` says (not a ``cp_backend`` value)."""


def named_backend(recipe: Recipe) -> BackendPolicy:
    """The backend the recipe's ``cp_backend`` names (whatever its context_parallel_size)."""
    return BACKENDS[recipe.cp_backend]


def backend_for(recipe: Recipe, cp_size: int | None = None) -> BackendPolicy:
    """The backend that runs the recipe at ``cp_size`` (default: its context_parallel_size): local at 1."""
    size = recipe.context_parallel_size if cp_size is None else cp_size
    return LOCAL if size <= 1 else named_backend(recipe)


__all__ = ["BACKENDS", "LOCAL", "backend_for", "named_backend"]
