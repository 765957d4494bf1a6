"""The rows of the backend table: one per ``cp_backend`` value, and what the recipe reads of them.

A new backend is a package beside this module and one row of :data:`ROWS` (its import, and its
entry). Its ``__init__`` names it (``NAME``, the ``cp_backend`` value; it imports nothing); its
``keys`` module gives its recipe keys (``KEYS``: a key group the recipe composes flat, so its keys
stay top-level in the YAML); its ``policy`` module defines ``POLICY`` (a
:class:`~cptune.parallel.backends.spec.BackendPolicy`), its ``runtime`` module the
:class:`~cptune.parallel.backends.spec.BackendRuntime` that ``POLICY.runtime()`` returns.
:mod:`cptune.parallel.backends.table` maps the names to the policies.

The recipe's schema imports this module (for :data:`NAMES` and :data:`KEY_GROUPS`), and the
policies are typed with that recipe: so this module loads each package's ``keys`` by module name,
never a policy, and nothing here imports torch.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from cptune.parallel.backends import deepspeed_ulysses, ring_flash_attn, torch_cp

if TYPE_CHECKING:
    from pydantic import BaseModel

ROWS: tuple[ModuleType, ...] = (ring_flash_attn, torch_cp, deepspeed_ulysses)
"""Every backend a recipe may name, in the order the docs list them (and the recipe its keys)."""

NAMES: tuple[str, ...] = tuple(row.NAME for row in ROWS)
"""The values of the recipe's ``cp_backend``."""

KEY_GROUPS: tuple[type[BaseModel], ...] = tuple(
    importlib.import_module(f"{row.__name__}.keys").KEYS for row in ROWS
)
"""Each backend's recipe keys, which the recipe composes (:class:`cptune.config.recipe.Recipe`)."""

__all__ = ["KEY_GROUPS", "NAMES", "ROWS"]
