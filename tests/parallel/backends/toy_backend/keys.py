"""The recipe keys of ``cp_backend: toy``."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ToyKeys(BaseModel):
    """Mixin of the recipe: how many rounds the toy ring turns."""

    # --- context parallelism: toy ------------------------------------------------------------
    toy_ring_rounds: int | None = Field(
        None, ge=1, description="cp_backend: toy: rounds of its ring; default 1."
    )


KEYS = ToyKeys
