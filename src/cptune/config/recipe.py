"""The recipe: one frozen, validated object that every layer of cptune reads.

Key names follow Axolotl where Axolotl has the concept, so users can bring their
recipes. Keys Axolotl lacks (``cp_backend``, ``causal``, ...) are cptune's own.
Problems that involve several keys are collected by :func:`combination_problems`
so that the loader can report them together with per-key type errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cptune.config.axolotl.fsdp1 import (
    Fsdp1Keys,
    ShardingStrategy,
    fsdp1_rules,
    resolved_fsdp_config,
    sharding_strategy_name,
)
from cptune.config.axolotl.mapped import (
    AdapterKeys,
    AxolotlKeys,
    ChatTemplateName,
    OptimizerKeys,
    OptimizerName,
    QuantizationKeys,
    TokenKeys,
    TrackingKeys,
    TrainOnEos,
)
from cptune.config.axolotl.rules import COMPAT_RULES, CUT_CROSS_ENTROPY_PLUGIN
from cptune.parallel.backends.rows import KEY_GROUPS, NAMES
from cptune.parallel.backends.table import BACKENDS, named_backend

DatasetType = Literal["alpaca", "chat_template", "completion", "pretokenized"]
# Exactly the backend table's names, as a Literal: the field keeps pydantic's literal message
# (and the loader's "did you mean"), and recipe.cp_backend stays the plain string.
CpBackend = Literal[NAMES]  # type: ignore[valid-type]
FsdpStateDictType = Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class DatasetConfig(_Frozen):
    """One dataset source and how to read its rows."""

    path: str = Field(description="Local file or folder, a `save_to_disk` folder, or a hub dataset id.")
    type: DatasetType = Field("alpaca", description="Row format.")
    split: str = Field("train", description="Split to read.")
    data_files: str | tuple[str, ...] | None = Field(None, description="Files to read inside `path`.")
    name: str | None = Field(None, description="Hub dataset configuration name.")
    revision: str | None = Field(None, description="Hub dataset revision.")
    # alpaca
    field_instruction: str = Field("instruction", description="alpaca: column of the instruction.")
    field_input: str = Field("input", description="alpaca: column of the optional input.")
    field_output: str = Field("output", description="alpaca: column of the response (the trained part).")
    # chat_template
    field_messages: str = Field("messages", description="chat_template: column of the list of messages.")
    message_field_role: str = Field("role", description="chat_template: key of a message's role.")
    message_field_content: str = Field("content", description="chat_template: key of a message's text.")
    roles_to_train: tuple[str, ...] = Field(
        ("assistant",),
        description="chat_template: roles whose messages are trained (unless train_on_inputs).",
    )
    field_thinking: str = Field(
        "reasoning_content",
        description="chat_template: key of an assistant message's reasoning, for templates that show it (qwen3 "
        "writes it in a <think> block; it may also be written in the content as <think>...</think>).",
    )
    message_property_mappings: dict[str, str] | None = Field(
        None,
        description="chat_template: Axolotl's way to name a message's keys, e.g. {role: from, content: value} "
        "(the same as message_field_role, message_field_content and, for reasoning_content, field_thinking).",
    )
    roles: dict[str, tuple[str, ...]] | None = Field(
        None,
        description="chat_template: the role names of the data for each template role, e.g. {user: [human], "
        "assistant: [gpt]}; default: human -> user, gpt -> assistant (as Axolotl).",
    )
    train_on_eos: TrainOnEos = Field(
        "turn",
        description="chat_template: which end-of-turn tokens are trained: `turn` (those of trained turns), "
        "`last` (the last trained turn's), `all` (every turn's), `none`.",
    )
    # completion
    field: str = Field("text", description="completion: column of the text; every token is trained.")
    # pretokenized
    field_input_ids: str = Field("input_ids", description="pretokenized: column of the token ids.")
    field_labels: str = Field(
        "labels",
        description="pretokenized: column of the labels (-100: not trained); absent: train every token.",
    )

    @field_validator("message_property_mappings")
    @classmethod
    def _role_and_content_only(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        other = sorted(set(value or {}) - {"role", "content", "reasoning_content"})
        if other:
            raise ValueError(
                f"maps {', '.join(other)}; cptune's chat messages have a role, a content and a reasoning_content "
                "only (map those, or set message_field_role, message_field_content and field_thinking)"
            )
        return value

    @property
    def resolved_message_fields(self) -> tuple[str, str]:
        """The keys of a message's role and text (message_property_mappings wins over message_field_*)."""
        mappings = self.message_property_mappings or {}
        return mappings.get("role", self.message_field_role), mappings.get(
            "content", self.message_field_content
        )

    @property
    def resolved_reasoning_field(self) -> str:
        """The key of a message's reasoning (message_property_mappings' reasoning_content wins over field_thinking)."""
        return (self.message_property_mappings or {}).get("reasoning_content", self.field_thinking)


class FsdpConfig(_Frozen):
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
        "(GPU runs; much slower, for models whose states do not fit on the GPUs).",
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


class Recipe(
    QuantizationKeys,
    AdapterKeys,
    TokenKeys,
    OptimizerKeys,
    TrackingKeys,
    AxolotlKeys,
    Fsdp1Keys,
    *reversed(KEY_GROUPS),  # each backend's keys (its package's KEYS), in the table's order
    _Frozen,
):
    """A validated training recipe (reference: ``docs/reference/recipe.md``, generated from this class).

    Its keys are its own and those of its key groups (mixins): the Axolotl compatibility groups
    and each context-parallel backend's (:data:`cptune.parallel.backends.table.KEY_GROUPS`), all at
    the top level of the YAML.
    """

    # --- model -----------------------------------------------------------
    base_model: str = Field(description="Local folder or hub id of the model to fine-tune.")
    tokenizer_config: str | None = Field(None, description="Tokenizer folder or hub id; default: base_model.")
    trust_remote_code: bool = Field(False, description="Allow code shipped with the model to run.")
    model_revision: str | None = Field(None, description="Hub revision of base_model.")

    # --- data ------------------------------------------------------------
    datasets: tuple[DatasetConfig, ...] = Field(min_length=1, description="Training data sources.")
    test_datasets: tuple[DatasetConfig, ...] | None = Field(None, description="Evaluation data sources.")
    val_set_size: float = Field(
        0.0, ge=0, description="Held-out share (<1) or row count (>=1) of the training rows."
    )
    dataset_prepared_path: str = Field("prepared", description="Folder of the preprocessed-data cache.")
    dataset_processes: int | None = Field(None, ge=1, description="Worker processes for tokenization.")
    sequence_len: int = Field(2048, ge=2, description="Tokens per training row.")
    sample_packing: bool = Field(False, description="Pack several samples into each row.")
    pad_to_sequence_len: bool = Field(False, description="Pad every batch to sequence_len.")
    train_on_inputs: bool = Field(False, description="Also train on prompt tokens.")
    excess_length_strategy: Literal["drop", "truncate"] = Field(
        "drop", description="What to do with samples longer than sequence_len."
    )
    skip_invalid_rows: bool = Field(False, description="Skip (and count) malformed rows instead of stopping.")
    chat_template: ChatTemplateName | None = Field(
        None,
        description="Chat template for chat_template datasets, by name (cptune's own rendering of each family's "
        "format; `jinja`: chat_template_jinja); default: the tokenizer's.",
    )

    # --- adapter -----------------------------------------------------------
    adapter: Literal["lora", "qlora"] | None = Field(
        None,
        description="`lora`, `qlora` (LoRA on a 4-bit base, with load_in_4bit), or unset for a full fine-tune.",
    )
    lora_r: int = Field(8, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(
        16, ge=1, description="LoRA scaling numerator (the update is scaled by alpha / r)."
    )
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    lora_target_modules: tuple[str, ...] | None = Field(
        None, description="Module names to adapt; default: every linear layer except the output head."
    )
    lora_target_linear: bool = Field(
        False,
        description="Adapt every linear layer except the output head (also what happens when "
        "lora_target_modules is unset).",
    )

    # --- training ----------------------------------------------------------
    micro_batch_size: int = Field(1, ge=1, description="Rows per process per forward pass.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro batches per optimizer step.")
    num_epochs: float = Field(
        1.0, gt=0, description="Passes over the training rows (max_steps wins when set)."
    )
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    optimizer: OptimizerName = Field(
        "adamw_torch",
        description="The Trainer's optimizer by its name (8-bit and paged ones need bitsandbytes, *_torch_4bit/8bit "
        "torchao); cptune refuses before launching one that cannot run here, saying why.",
    )
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "cosine", description="Learning-rate schedule after warmup."
    )
    warmup_steps: int | None = Field(None, ge=0, description="Warmup length in optimizer steps.")
    warmup_ratio: float | None = Field(None, ge=0, lt=1, description="Warmup length as a share of all steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping; 0 disables.")
    seed: int = Field(42, description="Seed of the LoRA init, data order and validation split.")
    bf16: bool | Literal["auto"] = Field(
        False, description="Train in bfloat16 (`auto`: when the GPU has it)."
    )
    fp16: bool = Field(False, description="Train in float16 with loss scaling.")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each layer in the backward pass: less activation memory, "
        "about one more forward pass of compute.",
    )
    output_dir: str = Field(
        "./outputs", description="Where the model/adapter, checkpoints and train_log.json go."
    )
    overwrite_output_dir: bool = Field(
        False,
        description="Start afresh in an output_dir that holds an earlier run (its checkpoints and train "
        "log are removed); without it cptune refuses, so a finished run is never replaced by mistake.",
    )
    logging_steps: int = Field(
        1, ge=1, description="Log loss, learning rate and tokens/s every this many steps."
    )
    save_steps: int | None = Field(
        None, ge=1, description="Write a checkpoint-N folder every this many steps."
    )
    save_total_limit: int | None = Field(
        None, ge=1, description="Keep only the newest this many checkpoints."
    )
    resume_from_checkpoint: bool | str | None = Field(
        None,
        description="`true`: continue from the newest complete checkpoint in output_dir; or a checkpoint path.",
    )
    eval_steps: int | None = Field(
        None, ge=1, description="Evaluate every this many steps and at the end (needs evaluation data)."
    )
    report_to: tuple[Literal["tensorboard", "wandb", "none"], ...] = Field(
        ("none",), description="Loggers besides train_log.json; one name or a list."
    )
    dataloader_num_workers: int = Field(0, ge=0, description="Data-loader worker processes per rank.")
    ddp_timeout: int = Field(
        1800,
        ge=1,
        description="Seconds a collective may wait for the other processes before the run fails "
        "(a hung or lost process then stops the run instead of holding it forever), on GPUs "
        "and on CPU alike.",
    )

    # --- memory for long sequences ----------------------------------------------
    activation_offloading: bool | Literal["legacy", "hidden_states", "disk"] = Field(
        False,
        description="Keep the layer inputs that gradient checkpointing saves in (pinned) host memory between "
        "the forward and the backward pass, copied back on a side stream while the layer after runs; exact. "
        "Needs gradient_checkpointing: true and host RAM for them (`cptune validate` says how much). Axolotl's "
        "`legacy` and `hidden_states` (and `gradient_checkpointing: offload`) mean the same here; `disk` is refused.",
    )
    tiled_mlp: bool = Field(
        False,
        description="Run each decoder layer's MLP over tiles of the sequence, recomputing one tile at a time in the "
        "backward pass, so its intermediates exist for one tile only (ALST's TiledMLP); works with LoRA and every "
        "cp_backend. Weight gradients are summed tile by tile (same values up to summation order).",
    )
    tiled_mlp_num_shards: int | None = Field(
        None,
        ge=1,
        description="Tiles per MLP call with tiled_mlp; default ceil(tokens per rank / hidden size), as in ALST.",
    )
    tiled_mlp_use_original_mlp: bool = Field(
        True, description="Accepted for Axolotl recipes: cptune always tiles the model's own MLP module."
    )
    cut_cross_entropy: bool | None = Field(
        None,
        description="Compute the loss from the final hidden states and the output layer a chunk of tokens at a "
        "time, recomputed in the backward pass, so the full logits never exist (plain PyTorch, exact per token; "
        "what Axolotl's CutCrossEntropyPlugin does); default: on when plugins lists that plugin.",
    )
    liger_fused_linear_cross_entropy: bool = Field(
        False,
        description="The same chunked loss as cut_cross_entropy (accepted for Axolotl's LigerPlugin recipes).",
    )
    plugins: tuple[str, ...] | None = Field(
        None,
        description="Axolotl plugins: the CutCrossEntropyPlugin and LigerPlugin map onto cptune's chunked loss; "
        "others are refused.",
    )

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

    # --- context parallelism --------------------------------------------------
    context_parallel_size: int = Field(1, ge=1, description="Processes that split each sequence.")
    cp_backend: CpBackend = Field(
        "ring-flash-attn", description="How attention is computed across the split."
    )
    causal: bool = Field(True, description="false: bidirectional attention within each document.")

    @field_validator("report_to", "lora_target_modules", "plugins", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @property
    def is_lora(self) -> bool:
        """A LoRA adapter is trained (on a full-precision base, or on a quantized one: qlora, load_in_8bit)."""
        return self.adapter in ("lora", "qlora")

    @property
    def is_fsdp(self) -> bool:
        """FSDP2 sharding of the model states is asked for (it takes effect with more than one process)."""
        return self.fsdp_version == 2

    @property
    def resolved_fsdp_config(self) -> FsdpConfig:
        """``fsdp_config`` with what Axolotl's FSDP1 keys ask for (:mod:`cptune.config.axolotl.fsdp1`)."""
        return resolved_fsdp_config(self, self.fsdp_config or FsdpConfig())

    @property
    def offloads_activations(self) -> bool:
        """Checkpointed layer inputs go to host memory (``activation_offloading`` true, or Axolotl's CPU modes)."""
        return self.activation_offloading in (True, "legacy", "hidden_states")

    @property
    def resolved_gradient_checkpointing(self) -> bool:
        return self.gradient_checkpointing or (
            self.is_fsdp and self.resolved_fsdp_config.activation_checkpointing
        )

    @property
    def resolved_head_loss(self) -> bool:
        """The loss is computed from the hidden states in chunks (cut_cross_entropy or its Axolotl spellings)."""
        if self.cut_cross_entropy is not None:
            return self.cut_cross_entropy or self.liger_fused_linear_cross_entropy
        listed = any(p.rsplit(".", 1)[-1] == CUT_CROSS_ENTROPY_PLUGIN for p in self.plugins or ())
        return listed or self.liger_fused_linear_cross_entropy

    @property
    def memory_features(self) -> tuple[str, ...]:
        """The recipe keys of the memory features that are on, for plan lines and estimates."""
        names = (
            ("activation_offloading", self.offloads_activations),
            ("tiled_mlp", self.tiled_mlp),
            ("cut_cross_entropy", self.resolved_head_loss),
        )
        return tuple(name for name, on in names if on)

    @property
    def resolved_dp_replicate_size(self) -> int:
        return self.dp_replicate_size or 1

    @property
    def default_process_count(self) -> int:
        """Processes to start on one node when the command line does not say (``--nproc-per-node``)."""
        group = self.resolved_dp_replicate_size * self.context_parallel_size * self.tensor_parallel_size
        if self.dp_shard_size is not None:
            return group * self.dp_shard_size
        return group

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_config or self.base_model


# A rule reads a recipe (possibly only partly valid) and yields (key, message).
Rule = Callable[[Recipe], Iterator[tuple[str, str]]]


def _precision(r: Recipe) -> Iterator[tuple[str, str]]:
    """Precision.

    - `bf16: true` and `fp16: true` together are refused: choose one (or neither for fp32).
    """
    if r.bf16 is True and r.fp16:
        yield "fp16", "bf16 and fp16 are both true; choose one (or neither for fp32)."


def _warmup(r: Recipe) -> Iterator[tuple[str, str]]:
    """Warmup.

    - `warmup_steps` and `warmup_ratio` together are refused: set one.
    """
    if r.warmup_steps is not None and r.warmup_ratio is not None:
        yield "warmup_ratio", "set either warmup_steps or warmup_ratio, not both."


def _evaluation(r: Recipe) -> Iterator[tuple[str, str]]:
    """Evaluation data.

    - `val_set_size` and `test_datasets` together are refused: set one.
    - `val_set_size` of 1 or more counts rows and must be a whole number.
    - `eval_steps` needs evaluation data: `val_set_size` or `test_datasets`.
    """
    if r.val_set_size and r.test_datasets:
        yield "val_set_size", "set either val_set_size or test_datasets, not both."
    if r.val_set_size >= 1 and r.val_set_size != int(r.val_set_size):
        yield (
            "val_set_size",
            f"{r.val_set_size} is 1 or more, so it counts rows and must be a whole number; "
            "use a whole number of rows, or a share below 1.",
        )
    if r.eval_steps is not None and not (r.val_set_size or r.test_datasets):
        yield "eval_steps", "evaluation needs data: set val_set_size or test_datasets."


def _output(r: Recipe) -> Iterator[tuple[str, str]]:
    """Output folder.

    - `overwrite_output_dir: true` and `resume_from_checkpoint` are refused together: one starts
      afresh, the other continues the earlier run.
    """
    if r.overwrite_output_dir and r.resume_from_checkpoint not in (None, False):
        yield (
            "overwrite_output_dir",
            "resume_from_checkpoint continues the earlier run in output_dir, overwrite_output_dir starts "
            "afresh and removes it; set only one of them.",
        )


def _context_parallel(r: Recipe) -> Iterator[tuple[str, str]]:
    """Context parallelism.

    - `sequence_len` must hold at least one chunk per rank: `context_parallel_size` chunks, or twice
      that for `batch_zigzag` and for `cp_backend: torch` with load balancing.
    - Each backend's own keys and combinations: the sections below.
    """
    chunks = r.context_parallel_size * named_backend(r).chunks_per_rank(r)
    if r.sequence_len < chunks:
        yield (
            "sequence_len",
            f"{r.sequence_len} tokens cannot be split into the {chunks} chunks that "
            f"context_parallel_size={r.context_parallel_size} needs; use a longer sequence_len "
            "or a smaller context_parallel_size.",
        )


def _adapter(r: Recipe) -> Iterator[tuple[str, str]]:
    """LoRA.

    - `lora_target_modules` must not be an empty list.
    """
    if r.lora_target_modules is not None and len(r.lora_target_modules) == 0:
        yield "lora_target_modules", "is empty; list module names or set lora_target_linear: true."


def _fsdp(r: Recipe) -> Iterator[tuple[str, str]]:
    """Sharding of model states (FSDP2).

    - `fsdp_version: 1` is refused: cptune shards with FSDP2 only.
    - `fsdp_config`, `dp_shard_size` and `dp_replicate_size` need `fsdp_version: 2`.
    """
    if r.fsdp_version == 1 and not r.fsdp:  # with Axolotl's fsdp list: fsdp1_rules names both keys
        yield (
            "fsdp_version",
            "FSDP1 is not supported (transformers deprecates it); use fsdp_version: 2, which shards the same "
            "model states with FSDP2.",
        )
    if r.fsdp_version is None:
        for key in ("fsdp_config", "dp_shard_size", "dp_replicate_size"):
            if getattr(r, key) is not None:
                yield (
                    key,
                    "applies only with fsdp_version: 2 (without FSDP every rank holds the whole model and the "
                    "data-parallel size is the number of processes / context_parallel_size); set fsdp_version: 2 "
                    "or remove it.",
                )
        return


def _tensor_parallel(r: Recipe) -> Iterator[tuple[str, str]]:
    """Tensor parallelism.

    - `tensor_parallel_size` > 1 needs `fsdp_version: 2` (the tensor-parallel pieces are sharded and their
      gradients averaged by FSDP2).
    - It trains full fine-tunes only (no `adapter`) with `cp_backend: ring-flash-attn`; DeepSpeed
      (`deepspeed`, `zero_stage`) is refused with it.
    - The model's attention heads and key/value heads must divide by it (checked when the model's config is
      read).
    """
    if r.tensor_parallel_size == 1:
        return
    size = f"tensor_parallel_size={r.tensor_parallel_size}"
    if r.fsdp_version != 2:
        yield (
            "tensor_parallel_size",
            f"{size} needs fsdp_version: 2 (FSDP2 shards the tensor-parallel pieces and averages their "
            "gradients); set it, or remove tensor_parallel_size.",
        )
    if r.adapter is not None:
        yield (
            "adapter",
            f"{r.adapter} with {size} is not supported (LoRA layers are not split over tensor-parallel ranks); "
            "train the adapter with context_parallel_size and FSDP2 alone, or remove tensor_parallel_size.",
        )
    if r.context_parallel_size > 1 and not named_backend(r).takes_tensor_parallel:
        able = " or ".join(f"cp_backend: {b.name}" for b in BACKENDS.values() if b.takes_tensor_parallel)
        yield (
            "cp_backend",
            f"{r.cp_backend} with {size} is not supported; use {able}, which rings over "
            "each tensor-parallel rank's own heads.",
        )
    for key in ("deepspeed", "zero_stage"):
        if getattr(r, key) is not None:
            yield (
                key,
                f"DeepSpeed with {size} is not supported (cptune's tensor parallelism runs under FSDP2); "
                "shard with fsdp_version: 2 instead.",
            )


def _memory(r: Recipe) -> Iterator[tuple[str, str]]:
    """Memory for long sequences.

    - `activation_offloading` takes `true` or `false` (Axolotl's CPU modes `legacy` and `hidden_states` mean
      `true`; `disk` is refused) and needs `gradient_checkpointing: true` (it offloads the layer inputs that
      checkpointing keeps).
    - `tiled_mlp_num_shards` needs `tiled_mlp: true`; `tiled_mlp_use_original_mlp: false` is refused.
    """
    if r.activation_offloading == "disk":
        yield (
            "activation_offloading",
            "'disk' (Axolotl's offloading to files) is not supported; cptune offloads to host memory with "
            "activation_offloading: true.",
        )
    elif r.offloads_activations and not r.resolved_gradient_checkpointing:
        yield (
            "activation_offloading",
            "offloads the layer inputs that gradient checkpointing keeps for the backward pass; set "
            "gradient_checkpointing: true as well.",
        )
    if r.tiled_mlp_num_shards is not None and not r.tiled_mlp:
        yield (
            "tiled_mlp_num_shards",
            "applies only with tiled_mlp: true; set it or remove tiled_mlp_num_shards.",
        )
    if not r.tiled_mlp_use_original_mlp:
        yield (
            "tiled_mlp_use_original_mlp",
            "cptune always tiles the model's own MLP module (with its LoRA layers); remove the key or set it true.",
        )


RULES: tuple[Rule, ...] = (
    _precision,
    _warmup,
    _evaluation,
    _output,
    _context_parallel,
    *(backend.recipe_rules for backend in BACKENDS.values()),
    _fsdp,
    fsdp1_rules,
    _tensor_parallel,
    _adapter,
    *COMPAT_RULES,
    _memory,
)


def combination_problems(recipe: Recipe) -> list[tuple[str, str]]:
    """Problems that involve several keys, as (key path, message) pairs."""
    problems: list[tuple[str, str]] = []
    for rule in RULES:
        try:
            problems.extend(rule(recipe))
        except (AttributeError, TypeError):
            # The recipe was only partly valid (built from the keys that passed
            # field validation); a rule that needs a broken key stays silent
            # because that key already has its own error.
            continue
    return problems
