"""What every part of the recipe schema shares: frozen models that refuse unknown keys."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

FROZEN = ConfigDict(frozen=True, extra="forbid", validate_default=True)
"""Validated once, never changed; an unknown key is an error; defaults are validated too."""


class Frozen(BaseModel):
    """Base of the recipe's sections (datasets, fsdp_config, ...) and of the recipe itself."""

    model_config = FROZEN


def one_or_many(value: Any) -> Any:
    """A list key given one string: the list of that string (Axolotl recipes write both)."""
    return (value,) if isinstance(value, str) else value
