"""The recipe keys of ``cp_backend: ring-flash-attn`` (top-level keys of the recipe)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

RingAttnFunc = Literal["varlen_llama3", "batch_zigzag"]


class RingFlashAttnKeys(BaseModel):
    """Mixin of :class:`~cptune.config.recipe.Recipe`: which ring-flash-attn function runs and how it gathers."""

    # --- context parallelism: ring-flash-attn --------------------------------------------
    ring_attn_func: RingAttnFunc | None = Field(
        None, description="ring-flash-attn algorithm; default varlen_llama3."
    )
    heads_k_stride: int = Field(1, ge=1, description="KV heads gathered at a time by varlen_llama3.")

    @property
    def resolved_ring_attn_func(self) -> RingAttnFunc:
        return self.ring_attn_func or "varlen_llama3"


KEYS = RingFlashAttnKeys
"""The backend's key group (what :mod:`cptune.parallel.backends.rows` reads)."""
