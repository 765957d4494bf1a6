"""Recipe keys that Axolotl recipes carry: QLoRA, experiment trackers, tokens, and keys cptune maps.

The classes here are mixins of :class:`~cptune.config.recipe.Recipe` (its keys stay top-level, as in
Axolotl). Keys whose meaning in cptune differs from Axolotl's get a note that ``cptune validate``
prints (:func:`axolotl_notes`); combinations that cannot work are refused by the rules in
:data:`COMPAT_RULES`, each naming the key and what to do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

BUILT_IN_CHAT_TEMPLATES = (
    "chatml",
    "llama3",
    "qwen_25",
    "qwen3",
    "mistral_v1",
    "mistral_v2v3",
    "mistral_v3_tekken",
    "gemma",
    "phi_3",
)
"""Axolotl's chat template names that cptune renders with its own templates (:mod:`cptune.data.chat_templates`)."""

ChatTemplateName = Literal[
    "tokenizer_default",
    "jinja",
    "chatml",
    "llama3",
    "qwen_25",
    "qwen3",
    "mistral_v1",
    "mistral_v2v3",
    "mistral_v3_tekken",
    "gemma",
    "phi_3",
]

# The Trainer's optimizer names (transformers 5.23 OptimizerNames, tests/config checks they agree);
# cptune refuses at launch only those that cannot run here (cptune.run.optimizers).
OptimizerName = Literal[
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_torch_xla",
    "adamw_torch_npu_fused",
    "adafactor",
    "adamw_anyprecision",
    "adamw_torch_4bit",
    "adamw_torch_8bit",
    "ademamix",
    "sgd",
    "adagrad",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "ademamix_8bit",
    "lion_8bit",
    "lion_32bit",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "paged_ademamix_32bit",
    "paged_ademamix_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adafactor",
    "galore_adamw_layerwise",
    "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise",
    "lomo",
    "adalomo",
    "grokadamw",
    "schedule_free_radam",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "apollo_adamw",
    "apollo_adamw_layerwise",
    "stable_adamw",
]

TrainOnEos = Literal["turn", "all", "last", "none"]
TorchDtypeName = Literal["bfloat16", "float16", "float32"]

_FROZEN = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def _as_tuple(value: Any) -> Any:
    return (value,) if isinstance(value, str) else value


class BnbConfig(BaseModel):
    """How bitsandbytes quantizes the base model (Axolotl's ``bnb_config_kwargs``)."""

    model_config = _FROZEN

    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    bnb_4bit_use_double_quant: bool = Field(
        True, description="Quantize the quantization constants too (about 0.4 bits per weight less)."
    )
    bnb_4bit_compute_dtype: TorchDtypeName | None = Field(
        None, description="dtype of the 4-bit matmuls; default: the training dtype (bf16/fp16/fp32)."
    )
    bnb_4bit_quant_storage: TorchDtypeName | Literal["uint8"] | None = Field(
        None,
        description="dtype the packed 4-bit weights are stored in; default: the training dtype. Under FSDP2 a "
        "float dtype is sharded with the other weights; uint8 is kept whole on every rank.",
    )
    llm_int8_threshold: float = Field(6.0, ge=0, description="8-bit: outlier threshold of LLM.int8().")
    llm_int8_skip_modules: tuple[str, ...] | None = Field(
        None, description="Module names left unquantized; default: the output head."
    )

    @field_validator("llm_int8_skip_modules", mode="before")
    @classmethod
    def _many_llm_int8_skip_modules(cls, value: Any) -> Any:
        return _as_tuple(value)


class SpecialTokens(BaseModel):
    """Special tokens to set on the tokenizer (Axolotl's ``special_tokens``); new ones are added."""

    model_config = _FROZEN

    bos_token: str | None = Field(None, description="Beginning-of-sequence token.")
    eos_token: str | None = Field(
        None, description="End-of-sequence token (rows of alpaca/completion end with it)."
    )
    pad_token: str | None = Field(None, description="Padding token (never trained).")
    unk_token: str | None = Field(None, description="Unknown token.")
    additional_special_tokens: tuple[str, ...] | None = Field(None, description="More special tokens.")


class QuantizationKeys(BaseModel):
    """Mixin: a base model quantized with bitsandbytes under a LoRA adapter (QLoRA)."""

    # --- quantized base model (QLoRA) ------------------------------------------
    load_in_4bit: bool = Field(
        False,
        description="Load the base model's linear layers in 4 bits (NF4, bitsandbytes) and train a LoRA adapter "
        "on them (needs adapter: qlora): about a quarter of bf16's weight memory.",
    )
    load_in_8bit: bool = Field(
        False, description="Load the base model's linear layers in 8 bits (LLM.int8()); needs adapter: lora."
    )
    bnb_config_kwargs: BnbConfig | None = Field(
        None, description="bitsandbytes settings (needs load_in_4bit or load_in_8bit)."
    )

    @property
    def is_quantized(self) -> bool:
        return self.load_in_4bit or self.load_in_8bit


class AdapterKeys(BaseModel):
    """Mixin: LoRA settings Axolotl has beyond the rank and targets."""

    # --- adapter (more) -----------------------------------------------------------
    lora_model_dir: str | None = Field(
        None,
        description="Start from this trained LoRA adapter (a folder with adapter_config.json) instead of a "
        "fresh one; its rank and targets win over lora_r and lora_target_modules.",
    )
    lora_modules_to_save: tuple[str, ...] | None = Field(
        None,
        description="Modules trained whole next to the adapter and saved with it, e.g. [embed_tokens, lm_head] "
        "to train the embeddings of new tokens.",
    )

    @field_validator("lora_modules_to_save", mode="before")
    @classmethod
    def _many_lora_modules_to_save(cls, value: Any) -> Any:
        return _as_tuple(value)


class TokenKeys(BaseModel):
    """Mixin: tokens added to or set on the tokenizer, and the chat template."""

    # --- tokens and chat templates -----------------------------------------------
    special_tokens: SpecialTokens | None = Field(
        None, description="Set bos/eos/pad/unk tokens; a token the tokenizer lacks is added."
    )
    tokens: tuple[str, ...] | None = Field(
        None,
        description="New tokens to add to the tokenizer; the model's embeddings grow to hold them (with LoRA, "
        "train them through lora_modules_to_save).",
    )
    chat_template_jinja: str | None = Field(
        None,
        description="A Jinja chat template (the text, or the path of a .jinja file) for chat_template datasets; "
        "goes with chat_template: jinja (or no chat_template).",
    )

    @field_validator("tokens", mode="before")
    @classmethod
    def _many_tokens(cls, value: Any) -> Any:
        return _as_tuple(value)


class TrackingKeys(BaseModel):
    """Mixin: experiment trackers (the Trainer's integrations); TensorBoard and train_log.json need nothing."""

    # --- experiment tracking ---------------------------------------------------------
    use_wandb: bool = Field(False, description="Log to Weights & Biases (also on when wandb_project is set).")
    wandb_project: str | None = Field(None, description="W&B project; setting it turns W&B logging on.")
    wandb_entity: str | None = Field(None, description="W&B team or user.")
    wandb_name: str | None = Field(None, description="W&B run name.")
    wandb_run_id: str | None = Field(None, description="W&B run id (to continue a run).")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="`offline` writes the run under output_dir/wandb with no network; sync it later."
    )
    wandb_watch: Literal["false", "gradients", "parameters", "all"] | None = Field(
        None, description="Log gradient and/or parameter histograms."
    )
    wandb_log_model: Literal["false", "checkpoint", "end"] | None = Field(
        None, description="Upload checkpoints or the final model as W&B artifacts."
    )
    use_tensorboard: bool = Field(
        False, description="Log to TensorBoard (the same as report_to: tensorboard)."
    )

    @field_validator("wandb_watch", "wandb_log_model", mode="before")
    @classmethod
    def _false_is_text(cls, value: Any) -> Any:
        # Axolotl writes `wandb_watch: false`; W&B reads the text "false".
        return "false" if value is False else value

    @property
    def wandb_enabled(self) -> bool:
        return self.use_wandb or self.wandb_project is not None

    @property
    def resolved_report_to(self) -> tuple[str, ...]:
        """The Trainer's loggers: report_to plus what the Axolotl switches (use_tensorboard, W&B) turn on."""
        loggers = [r for r in self.report_to if r != "none"]
        for name, on in (("tensorboard", self.use_tensorboard), ("wandb", self.wandb_enabled)):
            if on and name not in loggers:
                loggers.append(name)
        return tuple(loggers)


class OptimizerKeys(BaseModel):
    """Mixin: arguments of the Trainer's optimizers beyond the learning rate."""

    # --- optimizer arguments ----------------------------------------------------
    optim_args: str | dict[str, Any] | None = Field(
        None,
        description="Extra optimizer arguments, as the Trainer's optim_args (`key=value,...` or a mapping).",
    )
    optim_target_modules: tuple[str, ...] | None = Field(
        None, description="Modules GaLore/APOLLO optimizers project (the Trainer's optim_target_modules)."
    )

    @field_validator("optim_target_modules", mode="before")
    @classmethod
    def _many_optim_target_modules(cls, value: Any) -> Any:
        return _as_tuple(value)

    @property
    def resolved_optim_args(self) -> str | None:
        if isinstance(self.optim_args, dict):
            return ",".join(f"{key}={value}" for key, value in self.optim_args.items())
        return self.optim_args


class AxolotlKeys(BaseModel):
    """Mixin: Axolotl keys cptune accepts and maps onto its own behaviour (``cptune validate`` notes each)."""

    # --- Axolotl keys cptune maps -------------------------------------------------
    model_type: str | None = Field(
        None,
        description="`AutoModelForCausalLM` or the model's own class (e.g. LlamaForCausalLM), checked against "
        "base_model's config; cptune always loads with AutoModelForCausalLM.",
    )
    tokenizer_type: str | None = Field(
        None, description="Informational: cptune loads the class the tokenizer folder names (AutoTokenizer)."
    )
    tf32: bool | None = Field(None, description="Allow TF32 matmuls on NVIDIA GPUs; no effect on CPU.")
    bfloat16: bool | None = Field(None, description="The same as bf16 (an Axolotl spelling).")
    float16: bool | None = Field(None, description="The same as fp16 (an Axolotl spelling).")
    attn_implementation: str | None = Field(
        None,
        description="flash_attention_2/3 or sdpa are accepted; cptune picks the attention from cp_backend "
        "(validate says which runs).",
    )
    flash_attention: bool | None = Field(
        None, description="Accepted like attn_implementation: flash_attention_2."
    )
    sdp_attention: bool | None = Field(None, description="Accepted like attn_implementation: sdpa.")
    gradient_checkpointing_kwargs: dict[str, Any] | None = Field(
        None, description="Only `use_reentrant: false`, which is what cptune does."
    )
    evals_per_epoch: int | None = Field(
        None, ge=0, description="Evaluations per epoch (needs evaluation data; instead of eval_steps)."
    )
    saves_per_epoch: int | None = Field(
        None, ge=0, description="Checkpoints per epoch (instead of save_steps)."
    )
    eval_sample_packing: bool | None = Field(
        None,
        description="Accepted: evaluation rows are packed as training rows are (sample_packing); the eval loss "
        "is the same token mean either way.",
    )
    loss_watchdog_threshold: float | None = Field(
        None,
        gt=0,
        description="Stop training when the logged loss stays above this for loss_watchdog_patience logs.",
    )
    loss_watchdog_patience: int = Field(3, ge=1, description="Logs in a row above loss_watchdog_threshold.")
    min_sample_len: int | None = Field(
        None, ge=1, description="Drop samples shorter than this many tokens (counted in the data report)."
    )
    strict: bool | None = Field(None, description="Accepted; cptune always validates recipes strictly.")
    # Axolotl's fused kernels compute what the layers they replace compute (within rounding); cptune runs
    # those layers. Where a kernel drops LoRA inputs differently, config.axolotl.rules refuses the combination.
    lora_mlp_kernel: bool | None = Field(
        None,
        description="Accepted: cptune runs peft's LoRA layers, the same result without Axolotl's fused MLP "
        "kernel; refused with lora_dropout > 0 (the kernel shares one dropout mask between gate_proj and "
        "up_proj and drops nothing before down_proj).",
    )
    lora_qkv_kernel: bool | None = Field(
        None,
        description="Accepted: cptune runs peft's LoRA layers, the same result without Axolotl's fused q/k/v "
        "kernel; refused with lora_dropout > 0 (the kernel shares one dropout mask between q, k and v).",
    )
    lora_o_kernel: bool | None = Field(
        None,
        description="Accepted: cptune runs peft's LoRA layers, the same result without Axolotl's fused o_proj "
        "kernel.",
    )
    lora_embedding_kernel: bool | None = Field(
        None,
        description="Accepted: cptune runs peft's LoRA embedding layer, the same result without Axolotl's fused "
        "kernel.",
    )
    fused_attn_kernel: bool | None = Field(
        None,
        description="Accepted: cptune runs the model's own q/k RMSNorm and RoPE and the backend's attention, the "
        "same result without Axolotl's fused Triton kernel (which agrees within bf16 rounding).",
    )
    # The properties below read keys of Recipe itself (eval_steps, num_epochs, ...).

    @property
    def has_eval_data(self) -> bool:
        return bool(self.val_set_size or self.test_datasets)

    @property
    def resolved_eval_steps(self) -> float | None:
        """eval_steps, or Axolotl's evals_per_epoch as a share of the run's steps (the Trainer's float steps)."""
        if self.eval_steps is not None:
            return self.eval_steps
        if self.evals_per_epoch and self.has_eval_data:
            return _share_of_run(self.evals_per_epoch, self.num_epochs)
        return None

    @property
    def resolved_save_steps(self) -> float | None:
        """save_steps, or Axolotl's saves_per_epoch as a share of the run's steps."""
        if self.save_steps is not None:
            return self.save_steps
        if self.saves_per_epoch:
            return _share_of_run(self.saves_per_epoch, self.num_epochs)
        return None

    @property
    def attention_asked(self) -> str | None:
        """The attention implementation the Axolotl keys name, if any."""
        if self.attn_implementation is not None:
            return self.attn_implementation
        if self.flash_attention:
            return "flash_attention_2"
        if self.sdp_attention:
            return "sdpa"
        return None


def _share_of_run(per_epoch: int, epochs: float) -> float | None:
    """Every 1/(per_epoch × epochs) of the run, as Axolotl: None when that is the whole run or more."""
    share = 1 / (per_epoch * epochs)
    return share if share < 1 else None
