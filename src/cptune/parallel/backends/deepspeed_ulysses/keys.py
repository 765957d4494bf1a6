"""The recipe keys of ``cp_backend: deepspeed`` and of DeepSpeed's ZeRO engine (top-level keys of the recipe).

``zero_stage`` and ``deepspeed`` also run ring-flash-attn and torch CP under DeepSpeed's engine, and runs at
context_parallel_size 1 (:mod:`cptune.parallel.backends.zero`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

UlyssesAttnImplementation = Literal["cptune", "sdpa", "flash_attention_2", "flash_attention_3"]


class DeepSpeedKeys(BaseModel):
    """Mixin of :class:`~cptune.config.recipe.Recipe`: Ulysses' core attention and DeepSpeed's ZeRO engine."""

    # --- DeepSpeed: Ulysses (cp_backend: deepspeed) and ZeRO -----------------------------
    ulysses_attn_implementation: UlyssesAttnImplementation | None = Field(
        None,
        description="cp_backend: deepspeed: attention over the whole sequence after Ulysses' all-to-all; "
        "default cptune (keeps packed documents apart, runs anywhere).",
    )
    zero_stage: Literal[0, 1, 2, 3] | None = Field(
        None,
        description="DeepSpeed ZeRO stage: at context_parallel_size > 1 with cp_backend: deepspeed (default 0, or the "
        "stage in `deepspeed`), or ring-flash-attn / torch CP under DeepSpeed's engine; at context_parallel_size 1, "
        "ZeRO next to plain data parallelism.",
    )
    deepspeed: str | None = Field(
        None,
        description="A DeepSpeed JSON config (ZeRO and more): at context_parallel_size > 1 Ulysses with cp_backend: "
        "deepspeed, or ring-flash-attn / torch CP under DeepSpeed's engine; at context_parallel_size 1, ZeRO next to "
        "plain data parallelism (as Axolotl's recipes without CP).",
    )

    @property
    def resolved_ulysses_attn_implementation(self) -> UlyssesAttnImplementation:
        return self.ulysses_attn_implementation or "cptune"


KEYS = DeepSpeedKeys
"""The backend's key group (what :mod:`cptune.parallel.backends.rows` reads)."""
