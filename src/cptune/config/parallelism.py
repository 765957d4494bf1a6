"""The recipe's keys of parallelism: how model states are sharded (FSDP2, tensor parallelism) and how each
sequence is split (context parallelism; each backend's own keys are its package's key group)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from cptune.config.axolotl.fsdp1 import RESHARD, ShardingStrategy, sharding_strategy_name
from cptune.config.base import Frozen
from cptune.parallel.backends.rows import NAMES

# Exactly the backend table's names, as a Literal: the field keeps pydantic's literal message
# (and the loader's "did you mean"), and recipe.cp_backend stays the plain string.
CpBackend = Literal[NAMES]  # type: ignore[valid-type]
FsdpStateDictType = Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"]


class FsdpConfig(Frozen):
    """How FSDP2 shards the model states (Axolotl's ``fsdp_config``; a leading ``fsdp_`` on a key is accepted)."""

    reshard_after_forward: bool = Field(
        True,
        description="Free each layer's gathered weights after its forward pass and gather them again for the "
        "backward (less memory); false keeps them until the backward (FSDP1's SHARD_GRAD_OP).",
    )
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP"] = Field(
        "TRANSFORMER_BASED_WRAP", description="Each decoder layer is its own FSDP unit (the only policy)."
    )
    transformer_layer_cls_to_wrap: tuple[str, ...] | None = Field(
        None, description="Layer class names to shard one by one; default: the model's decoder layer class."
    )
    activation_checkpointing: bool = Field(
        False, description="The same as `gradient_checkpointing: true` (accepted for Axolotl recipes)."
    )
    offload_params: bool = Field(
        False,
        description="Keep the sharded weights, gradients and optimizer state in CPU memory between uses "
        "(GPU runs; slower, for models whose states do not fit on the GPUs, or to give a single GPU's memory "
        "to the sequence: with one process FSDP2 then runs over a mesh of one).",
    )
    state_dict_type: FsdpStateDictType = Field(
        "SHARDED_STATE_DICT",
        description="Accepted for Axolotl recipes; either way checkpoints are written sharded (each rank its "
        "part) and the final model is gathered into a standard Hugging Face folder, which is what "
        "FULL_STATE_DICT gives in Axolotl (`cptune validate` says so).",
    )
    # FSDP1 keys of Axolotl's recipes (cptune.config.axolotl.fsdp1 maps them onto FSDP2, `cptune validate` says how).
    sharding_strategy: ShardingStrategy | None = Field(
        None,
        description="FSDP1's strategy, mapped onto FSDP2: FULL_SHARD (1) is reshard_after_forward: true, "
        "SHARD_GRAD_OP (2) false; HYBRID_SHARD (4) and _HYBRID_SHARD_ZERO2 (5) need dp_replicate_size; "
        "NO_SHARD (3) is refused.",
    )
    limit_all_gathers: bool | None = Field(
        None, description="FSDP1 only: FSDP2 needs no all-gather rate limiter (accepted, not used)."
    )
    use_orig_params: bool | None = Field(
        None, description="FSDP1 only: FSDP2 always keeps the original parameters (accepted, not used)."
    )
    sync_module_states: bool | None = Field(
        None,
        description="FSDP1 only: every process loads the same base weights, so none are broadcast (accepted, "
        "not used).",
    )
    cpu_ram_efficient_loading: bool | None = Field(
        None,
        description="Accepted, not used: every process loads the base model before it is sharded (host memory "
        "for one copy per process on the node).",
    )

    @model_validator(mode="before")
    @classmethod
    def _without_fsdp_prefix(cls, data: Any) -> Any:
        # Axolotl's older recipes (and accelerate configs) spell the keys fsdp_offload_params, ...
        if not isinstance(data, dict):
            return data
        renamed: dict[Any, Any] = {}
        written: dict[Any, Any] = {}
        for key, value in data.items():
            plain = key[len("fsdp_") :] if isinstance(key, str) and key.startswith("fsdp_") else key
            if plain in renamed:
                raise ValueError(
                    f"'{written[plain]}' and '{key}' are the same key (with and without the fsdp_ prefix); "
                    "keep one of them"
                )
            renamed[plain], written[plain] = value, key
        return renamed

    @field_validator("sharding_strategy", mode="before")
    @classmethod
    def _strategy_name(cls, value: Any) -> Any:
        return sharding_strategy_name(value)

    @field_validator("transformer_layer_cls_to_wrap", mode="before")
    @classmethod
    def _one_or_many_layers(cls, value: Any) -> Any:
        # accelerate's configs give a comma-separated string; Axolotl's a class name.
        return tuple(v.strip() for v in value.split(",") if v.strip()) if isinstance(value, str) else value


class ShardingKeys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: FSDP2 and tensor parallelism."""

    # --- sharding of model states (FSDP2) -------------------------------------
    fsdp_version: Literal[1, 2] | None = Field(
        None,
        description="2: shard weights, gradients and optimizer state with FSDP2 across the dp_shard × cp ranks "
        "(full fine-tunes of models whose states do not fit one device); unset: plain DDP, every rank holds "
        "them whole.",
    )
    fsdp_config: FsdpConfig | None = Field(None, description="FSDP2 settings (needs fsdp_version: 2).")
    dp_shard_size: int | None = Field(
        None,
        ge=1,
        description="With FSDP2: data-parallel ranks that shard the model states together with the cp ranks; "
        "default: processes / (dp_replicate_size × context_parallel_size).",
    )
    dp_replicate_size: int | None = Field(
        None,
        ge=1,
        description="With FSDP2: copies of the sharded model (HSDP: shard within a group, e.g. a node, "
        "replicate across groups); default 1.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="With FSDP2: ranks that split each weight of the model's tensor-parallel plan (attention "
        "heads, MLP columns) and see the same tokens; full fine-tunes with cp_backend: ring-flash-attn.",
    )

    @model_validator(mode="before")
    @classmethod
    def _version_in_fsdp_config(cls, data: Any) -> Any:
        # Axolotl also reads the FSDP version from fsdp_config (version, or fsdp_version) when the recipe's
        # top level has none. The same version in both places is accepted too; one that differs stays in
        # fsdp_config, where it is refused (cptune.config.axolotl.keys).
        if not isinstance(data, dict) or not isinstance(data.get("fsdp_config"), dict):
            return data
        section = dict(data["fsdp_config"])
        for key in ("version", "fsdp_version"):
            if key in section and (data.get("fsdp_version") is None or data["fsdp_version"] == section[key]):
                data = {**data, "fsdp_version": section.pop(key)}
        return {**data, "fsdp_config": section}

    @property
    def is_fsdp(self) -> bool:
        """FSDP2 sharding of the model states is asked for (it takes effect with more than one process)."""
        return self.fsdp_version == 2

    @property
    def resolved_dp_replicate_size(self) -> int:
        return self.dp_replicate_size or 1


class ContextParallelKeys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: how many ranks split a sequence, and which backend."""

    # --- context parallelism --------------------------------------------------
    context_parallel_size: int = Field(1, ge=1, description="Processes that split each sequence.")
    cp_backend: CpBackend = Field(
        "ring-flash-attn", description="How attention is computed across the split."
    )
    causal: bool = Field(True, description="false: bidirectional attention within each document.")


def list_strategies(options: tuple[str, ...] | None) -> list[str]:
    """The sharding strategies named in Axolotl's ``fsdp`` list, upper case."""
    return [o.upper() for o in options or () if o.upper() in RESHARD]


def reshard_sources(options: tuple[str, ...] | None, config: FsdpConfig | None) -> list[tuple[str, bool]]:
    """(key as the user wrote it, reshard_after_forward it asks for), for each key that sets it."""
    sources: list[tuple[str, bool]] = []
    strategies = list_strategies(options)
    if len(strategies) == 1 and RESHARD[strategies[0]] is not None:
        sources.append((f"fsdp: {strategies[0].lower()}", bool(RESHARD[strategies[0]])))
    if config is not None:
        if config.sharding_strategy is not None and RESHARD[config.sharding_strategy] is not None:
            sources.append(
                (
                    f"fsdp_config.sharding_strategy: {config.sharding_strategy}",
                    bool(RESHARD[config.sharding_strategy]),
                )
            )
        if "reshard_after_forward" in config.model_fields_set:
            value = config.reshard_after_forward
            sources.append((f"fsdp_config.reshard_after_forward: {str(value).lower()}", value))
    return sources


def resolved_fsdp_config(options: tuple[str, ...] | None, set_config: FsdpConfig | None) -> FsdpConfig:
    """``fsdp_config`` (``set_config``, or the defaults) with what Axolotl's ``fsdp`` list (``options``) and
    FSDP1 keys ask for (``reshard_after_forward``, ``offload_params``)."""
    config = set_config or FsdpConfig()
    update: dict[str, Any] = {}
    sources = reshard_sources(options, set_config)
    if sources and "reshard_after_forward" not in config.model_fields_set:
        update["reshard_after_forward"] = sources[0][1]
    if "offload" in (options or ()) and "offload_params" not in config.model_fields_set:
        update["offload_params"] = True
    return config.model_copy(update=update) if update else config
