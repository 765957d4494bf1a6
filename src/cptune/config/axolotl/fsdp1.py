"""Axolotl's FSDP1 keys mapped onto cptune's FSDP2.

Axolotl recipes written for FSDP1 turn sharding on with ``fsdp: [full_shard, auto_wrap]`` (a list, or
one space-separated string, of transformers' ``FSDPOption`` names) and set ``fsdp_config`` keys that
FSDP1 has (``sharding_strategy``, ``limit_all_gathers``, ...). cptune shards with FSDP2 only:

- ``fsdp`` implies ``fsdp_version: 2``; ``full_shard``/``hybrid_shard`` free each layer's gathered
  weights after its forward (``reshard_after_forward: true``), ``shard_grad_op``/``hybrid_shard_zero2``
  keep them (``false``), ``offload`` is ``offload_params: true``, ``auto_wrap`` is what cptune always
  does (every decoder layer its own FSDP unit);
- ``fsdp_config.sharding_strategy`` (a name or FSDP1's enum number) maps the same way;
- the hybrid strategies need ``dp_replicate_size`` (cptune's HSDP), ``no_shard`` is refused (that is
  plain data parallelism, which cptune runs without FSDP);
- ``limit_all_gathers``, ``use_orig_params``, ``sync_module_states`` and ``cpu_ram_efficient_loading``
  are accepted and not used; ``cptune validate`` says what they mean here (:func:`fsdp1_notes`).

Keys that disagree (two strategies, a strategy against ``reshard_after_forward``, ``offload`` against
``offload_params: false``, ``fsdp`` with ``fsdp_version: 1``) are refused, naming both keys
(:func:`cptune.config.axolotl.rules.fsdp1_rules`). This module holds the names and the key group;
:func:`cptune.config.parallelism.resolved_fsdp_config` applies them to ``fsdp_config``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

FSDP1_CONFIG_KEYS = (
    "sharding_strategy",
    "limit_all_gathers",
    "use_orig_params",
    "sync_module_states",
    "cpu_ram_efficient_loading",
)
"""``fsdp_config`` keys of FSDP1 that cptune accepts (mapped onto FSDP2, or not used; validate says which)."""

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FsdpOption = Literal[
    "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap"
]

# FSDP1's ShardingStrategy enum numbers (torch.distributed.fsdp.ShardingStrategy, accelerate's configs).
_STRATEGY_NUMBERS = {
    1: "FULL_SHARD",
    2: "SHARD_GRAD_OP",
    3: "NO_SHARD",
    4: "HYBRID_SHARD",
    5: "HYBRID_SHARD_ZERO2",
}
# Whether FSDP2 frees a layer's gathered weights after its forward pass (None: nothing is sharded).
RESHARD: dict[str, bool | None] = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "NO_SHARD": None,
    "HYBRID_SHARD": True,
    "HYBRID_SHARD_ZERO2": False,
}
HYBRID = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


def sharding_strategy_name(value: Any) -> Any:
    """``1``/``"1"``/``"full_shard"``/``"HYBRID_SHARD_ZERO2"`` → the strategy's name; others unchanged."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool):
        return _STRATEGY_NUMBERS.get(value, value)
    if isinstance(value, str):
        return value.strip().upper().lstrip("_")
    return value


def written(options: tuple[str, ...]) -> str:
    """``fsdp``'s options as the user wrote them, as a YAML list."""
    return f"[{', '.join(options)}]"


class Fsdp1Keys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: Axolotl's FSDP1 switch."""

    # --- Axolotl's FSDP1 form (mapped onto FSDP2) ---------------------------------
    fsdp: tuple[FsdpOption, ...] | None = Field(
        None,
        description="Axolotl's FSDP1 form, e.g. [full_shard, auto_wrap]: runs with FSDP2 (implies fsdp_version: "
        "2; full_shard / shard_grad_op set reshard_after_forward, offload sets offload_params; every decoder "
        "layer is its own unit, as with auto_wrap).",
    )

    @field_validator("fsdp", mode="before")
    @classmethod
    def _space_separated(cls, value: Any) -> Any:
        # transformers' TrainingArguments.fsdp takes one string of options ("full_shard auto_wrap").
        return tuple(value.split()) if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _fsdp_means_fsdp2(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "fsdp" not in data:
            return data
        if data["fsdp"] in (None, "", [], ()):
            return {k: v for k, v in data.items() if k != "fsdp"}
        if data.get("fsdp_version") is None:
            return {**data, "fsdp_version": 2}
        return data
