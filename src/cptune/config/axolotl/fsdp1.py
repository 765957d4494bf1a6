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
``offload_params: false``, ``fsdp`` with ``fsdp_version: 1``) are refused, naming both keys.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

if TYPE_CHECKING:
    from cptune.config.recipe import FsdpConfig, Recipe

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
_RESHARD = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "NO_SHARD": None,
    "HYBRID_SHARD": True,
    "HYBRID_SHARD_ZERO2": False,
}
_HYBRID = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


def sharding_strategy_name(value: Any) -> Any:
    """``1``/``"1"``/``"full_shard"``/``"_HYBRID_SHARD_ZERO2"`` → the strategy's name; others unchanged."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool):
        return _STRATEGY_NUMBERS.get(value, value)
    if isinstance(value, str):
        return value.strip().upper().lstrip("_")
    return value


class Fsdp1Keys(BaseModel):
    """Axolotl's FSDP1 switch (a mixin of :class:`~cptune.config.recipe.Recipe`)."""

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


def _list_strategies(r: Recipe) -> list[str]:
    return [o.upper() for o in r.fsdp or () if o.upper() in _RESHARD]


def _reshard_sources(r: Recipe) -> list[tuple[str, bool]]:
    """(key as the user wrote it, reshard_after_forward it asks for), for each key that sets it."""
    sources: list[tuple[str, bool]] = []
    strategies = _list_strategies(r)
    if len(strategies) == 1 and _RESHARD[strategies[0]] is not None:
        sources.append((f"fsdp: {strategies[0].lower()}", bool(_RESHARD[strategies[0]])))
    config = r.fsdp_config
    if config is not None:
        if config.sharding_strategy is not None and _RESHARD[config.sharding_strategy] is not None:
            sources.append(
                (
                    f"fsdp_config.sharding_strategy: {config.sharding_strategy}",
                    bool(_RESHARD[config.sharding_strategy]),
                )
            )
        if "reshard_after_forward" in config.model_fields_set:
            value = config.reshard_after_forward
            sources.append((f"fsdp_config.reshard_after_forward: {str(value).lower()}", value))
    return sources


def resolved_fsdp_config(r: Recipe, config: FsdpConfig) -> FsdpConfig:
    """``config`` with what the FSDP1 keys ask for (``reshard_after_forward``, ``offload_params``)."""
    update: dict[str, Any] = {}
    sources = _reshard_sources(r)
    if sources and "reshard_after_forward" not in config.model_fields_set:
        update["reshard_after_forward"] = sources[0][1]
    if "offload" in (r.fsdp or ()) and "offload_params" not in config.model_fields_set:
        update["offload_params"] = True
    return config.model_copy(update=update) if update else config


def _written(options: tuple[str, ...]) -> str:
    return f"[{', '.join(options)}]"


def fsdp1_rules(r: Recipe) -> Iterator[tuple[str, str]]:
    """Axolotl's FSDP1 keys.

    - `fsdp` (Axolotl's FSDP1 form) is refused with `fsdp_version: 1`, and with more than one sharding
      strategy in it.
    - `no_shard` / `NO_SHARD` is refused: that is plain data parallelism, which cptune runs without FSDP.
    - `hybrid_shard` / `HYBRID_SHARD` (and their ZERO2 forms) need `dp_replicate_size`.
    - `fsdp`, `fsdp_config.sharding_strategy` and `fsdp_config.reshard_after_forward` must agree, and `offload`
      in `fsdp` with `fsdp_config.offload_params`.
    """
    options = r.fsdp or ()
    if options and r.fsdp_version == 1:
        yield (
            "fsdp_version",
            f"is 1, but fsdp: {_written(options)} asks for sharding that cptune runs with FSDP2 only; remove "
            "fsdp_version (fsdp implies fsdp_version: 2) or set it to 2.",
        )
    strategies = _list_strategies(r)
    if len(strategies) > 1:
        yield "fsdp", f"{_written(options)} lists {len(strategies)} sharding strategies; keep one."
    config = r.fsdp_config
    asked = [("fsdp", s.lower()) for s in strategies[:1]]
    if config is not None and config.sharding_strategy is not None:
        asked.append(("fsdp_config.sharding_strategy", config.sharding_strategy))
    for key, strategy in asked:
        if strategy.upper() == "NO_SHARD":
            yield (
                key,
                f"{strategy} is plain data parallelism (every rank holds the whole model), which cptune runs "
                "without FSDP: remove fsdp, fsdp_config and fsdp_version.",
            )
        elif strategy.upper() in _HYBRID and r.dp_replicate_size is None:
            yield (
                key,
                f"{strategy} shards within a group of ranks and replicates across groups; in cptune's FSDP2 "
                "that is dp_replicate_size (the number of copies, e.g. nodes): set it, and each copy is sharded "
                "over processes / (dp_replicate_size × context_parallel_size) ranks.",
            )
    sources = _reshard_sources(r)
    for key, value in sources[1:]:
        first, first_value = sources[0]
        if value != first_value:
            yield (
                key.split(":")[0],
                f"{key.split(': ')[1]} disagrees with {first}: one frees each layer's gathered weights after "
                "its forward pass (reshard_after_forward: true), the other keeps them for the backward (false); "
                "keep one of them.",
            )
    explicit = config is not None and "offload_params" in config.model_fields_set
    if "offload" in options and explicit and not config.offload_params:
        yield (
            "fsdp_config.offload_params",
            f"is false, but fsdp: {_written(options)} asks for offload; keep one of them.",
        )


def fsdp1_notes(r: Recipe) -> list[str]:
    """What the accepted FSDP1 keys do in cptune, one line each."""
    notes = []
    options = r.fsdp or ()
    resolved = r.resolved_fsdp_config
    if options:
        wrap = (
            "every decoder layer is its own FSDP unit (auto_wrap)"
            if "auto_wrap" in options
            else "every decoder layer is its own FSDP unit (cptune always wraps them, as auto_wrap does)"
        )
        notes.append(
            f"fsdp: {_written(options)} is Axolotl's FSDP1 form; cptune runs it with FSDP2: fsdp_version: 2, "
            f"reshard_after_forward: {str(resolved.reshard_after_forward).lower()}, offload_params: "
            f"{str(resolved.offload_params).lower()}; {wrap}."
        )
    config = r.fsdp_config
    if config is None:
        return notes
    if config.sharding_strategy is not None and config.sharding_strategy != "NO_SHARD":
        hybrid = ", one copy per dp_replicate_size group" if config.sharding_strategy in _HYBRID else ""
        notes.append(
            f"fsdp_config.sharding_strategy: {config.sharding_strategy} is FSDP1's; with FSDP2 it is "
            f"reshard_after_forward: {str(_RESHARD[config.sharding_strategy]).lower()}{hybrid}."
        )
    if config.limit_all_gathers is not None:
        notes.append(
            "fsdp_config.limit_all_gathers is not used: it rate-limits FSDP1's all-gathers, and FSDP2 frees each "
            "layer's gathered weights in a fixed order without one."
        )
    if config.use_orig_params is not None:
        notes.append(
            "fsdp_config.use_orig_params is not used: FSDP2 always keeps the original parameters (each a "
            "sharded DTensor), so the optimizer and LoRA see them as with use_orig_params: true."
        )
    if config.sync_module_states is not None:
        notes.append(
            "fsdp_config.sync_module_states is not used: every process loads the same base weights from "
            "base_model, so they start equal without a broadcast from rank 0."
        )
    if config.cpu_ram_efficient_loading is not None:
        notes.append(
            "fsdp_config.cpu_ram_efficient_loading is not used: every process loads the base model before it is "
            "sharded, so the host needs memory for one copy per process on the node."
        )
    return notes
