"""Recipe keys that Axolotl recipes carry: QLoRA, experiment trackers, tokens, and keys cptune maps.

The classes here are mixins of :class:`~cptune.config.recipe.Recipe` (its keys stay top-level, as in
Axolotl). Keys whose meaning in cptune differs from Axolotl's get a note that ``cptune validate``
prints (:func:`axolotl_notes`); combinations that cannot work are refused by the rules in
:data:`COMPAT_RULES`, each naming the key and what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe

BUILT_IN_CHAT_TEMPLATES = (
    "chatml",
    "llama3",
    "qwen_25",
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
    "mistral_v1",
    "mistral_v2v3",
    "mistral_v3_tekken",
    "gemma",
    "phi_3",
]

TrainOnEos = Literal["turn", "all", "last", "none"]
TorchDtypeName = Literal["bfloat16", "float16", "float32"]

# Attention implementations an Axolotl recipe may name, and what cptune runs instead.
_ATTENTION_NAMES = ("flash_attention_2", "flash_attention_3", "sdpa")

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
        None, description="dtype the packed 4-bit weights are stored in; default: the training dtype."
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
    plugins: tuple[str, ...] | None = Field(
        None, description="Axolotl plugins; each one is refused with a reason."
    )

    @field_validator("plugins", mode="before")
    @classmethod
    def _many_plugins(cls, value: Any) -> Any:
        return _as_tuple(value)

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


# --- rules ---------------------------------------------------------------------------

Rule = Callable[["Recipe"], Iterator[tuple[str, str]]]


def _quantization(r: Recipe) -> Iterator[tuple[str, str]]:
    """Quantized base models (QLoRA).

    - `adapter: qlora` needs `load_in_4bit: true`, and `load_in_4bit: true` needs `adapter: qlora`.
    - `load_in_8bit: true` needs `adapter: lora` (LoRA on an 8-bit base).
    - `bnb_config_kwargs` needs `load_in_4bit` or `load_in_8bit`.
    - A quantized base is refused with `fsdp_version: 2` (cptune does not shard bitsandbytes weights).
    """
    if r.adapter == "qlora" and not r.load_in_4bit:
        yield (
            "adapter",
            "qlora trains a LoRA adapter on a 4-bit base: set load_in_4bit: true (or use adapter: lora).",
        )
    if r.load_in_4bit and r.adapter != "qlora":
        yield (
            "load_in_4bit",
            "a 4-bit base model is trained through a LoRA adapter: set adapter: qlora, or remove load_in_4bit.",
        )
    if r.load_in_8bit and r.adapter != "lora":
        why = (
            "use load_in_4bit with qlora" if r.adapter == "qlora" else "8-bit weights cannot be trained whole"
        )
        yield "load_in_8bit", f"an 8-bit base model is trained through adapter: lora ({why}); or remove it."
    if r.bnb_config_kwargs is not None and not (r.load_in_4bit or r.load_in_8bit):
        yield "bnb_config_kwargs", "applies only with load_in_4bit or load_in_8bit; remove it."
    if (r.load_in_4bit or r.load_in_8bit) and r.fsdp_version is not None:
        yield (
            "fsdp_version",
            "cptune does not shard bitsandbytes-quantized weights with FSDP2; train a quantized base with plain "
            "data parallelism (remove fsdp_version) and any cp_backend, or use adapter: lora without quantization.",
        )


def _adapter_extras(r: Recipe) -> Iterator[tuple[str, str]]:
    """LoRA extras.

    - `lora_model_dir` and `lora_modules_to_save` need `adapter: lora` or `qlora`.
    """
    for key in ("lora_model_dir", "lora_modules_to_save"):
        if getattr(r, key) is not None and not r.is_lora:
            yield key, "applies only with adapter: lora or qlora; remove it."


def _chat_template(r: Recipe) -> Iterator[tuple[str, str]]:
    """Chat templates.

    - `chat_template: jinja` needs `chat_template_jinja`; `chat_template_jinja` goes with
      `chat_template: jinja` or no `chat_template`.
    """
    if r.chat_template == "jinja" and r.chat_template_jinja is None:
        yield "chat_template", "jinja needs the template in chat_template_jinja (its text or a .jinja file)."
    if r.chat_template_jinja is not None and r.chat_template not in (None, "jinja"):
        yield (
            "chat_template_jinja",
            f"chat_template: {r.chat_template} names another template; set chat_template: jinja (or remove one).",
        )


def _axolotl_mapped(r: Recipe) -> Iterator[tuple[str, str]]:
    """Axolotl keys cptune maps.

    - `attn_implementation` is one of `flash_attention_2`, `flash_attention_3` or `sdpa` (cptune picks the
      attention from `cp_backend`; eager, flex and others are refused).
    - `gradient_checkpointing_kwargs` may only say `use_reentrant: false`.
    - `evals_per_epoch` and `eval_steps` together are refused, and so are `saves_per_epoch` and `save_steps`.
    - `bfloat16` must agree with `bf16`, and `float16` with `fp16`.
    - `model_type` is `AutoModelForCausalLM` or a `...ForCausalLM` class (checked against the model's config
      when the model is checked).
    - Every entry of `plugins` is refused: cptune runs no Axolotl plugins.
    """
    if r.attn_implementation is not None and r.attn_implementation not in _ATTENTION_NAMES:
        yield (
            "attn_implementation",
            f"cptune does not run '{r.attn_implementation}' attention; it picks the attention from cp_backend "
            "(flash-attn kernels for ring-flash-attn, SDPA otherwise). Use flash_attention_2 or sdpa, or remove it.",
        )
    kwargs = r.gradient_checkpointing_kwargs
    if kwargs is not None and dict(kwargs) not in ({}, {"use_reentrant": False}):
        yield (
            "gradient_checkpointing_kwargs",
            f"{dict(kwargs)} is not supported: cptune checkpoints with use_reentrant: false only (the reentrant "
            "variant recomputes without the step's CP metadata); write use_reentrant: false or remove it.",
        )
    for per_epoch, steps in (("evals_per_epoch", "eval_steps"), ("saves_per_epoch", "save_steps")):
        if getattr(r, per_epoch) is not None and getattr(r, steps) is not None:
            yield (
                per_epoch,
                f"and {steps} both set how often (Axolotl's count per epoch, cptune's steps); set one of them.",
            )
    for axolotl, ours in (("bfloat16", "bf16"), ("float16", "fp16")):
        value = getattr(r, axolotl)
        if value is not None and value != (getattr(r, ours) is True):
            yield (
                axolotl,
                f"is {value} but {ours} is {getattr(r, ours)}; they are the same setting, set {ours} only.",
            )
    if r.model_type is not None and not r.model_type.endswith("ForCausalLM"):
        yield (
            "model_type",
            f"'{r.model_type}' is not a causal language model class; use AutoModelForCausalLM (or remove it).",
        )
    for index, plugin in enumerate(r.plugins or ()):
        yield f"plugins[{index}]", plugin_refusal(plugin)


COMPAT_RULES: tuple[Rule, ...] = (_quantization, _adapter_extras, _chat_template, _axolotl_mapped)
"""Rules over the keys of this module; :data:`cptune.config.recipe.RULES` includes them."""


# Axolotl plugins (the class path a recipe lists) -> why cptune refuses it and what to do. A plugin that
# gets a cptune equivalent moves out of this table into a mapping.
PLUGIN_REFUSALS: dict[str, str] = {
    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin": (
        "Cut Cross Entropy (Axolotl's fused linear cross-entropy) is not available in cptune yet; cptune computes "
        "the loss in chunks of tokens once the logits are large. Remove it."
    ),
    "axolotl.integrations.liger.LigerPlugin": (
        "Liger kernels are not available in cptune (its models run transformers' own layers); remove the plugin "
        "and the liger_* keys."
    ),
}


def plugin_refusal(plugin: str) -> str:
    """The one-line refusal of an Axolotl plugin."""
    reason = PLUGIN_REFUSALS.get(plugin)
    if reason is None:
        reason = "cptune runs no Axolotl plugins; remove it."
    return f"'{plugin}': {reason}"


# --- notes ---------------------------------------------------------------------------


def axolotl_notes(r: Recipe) -> list[str]:
    """What accepted Axolotl keys mean here where that differs from Axolotl, one line each."""
    notes = []
    asked = r.attention_asked
    if asked is not None:
        notes.append(
            f"attn_implementation: {asked} is not what picks the attention in cptune: at "
            "context_parallel_size 1 it is transformers' sdpa (which keeps packed samples apart), above 1 the "
            "cp_backend's (ring-flash-attn runs flash-attn's kernels when installed; deepspeed its "
            "ulysses_attn_implementation)."
        )
    if r.tokenizer_type not in (None, "AutoTokenizer"):
        notes.append(
            f"tokenizer_type: {r.tokenizer_type} is not used: cptune loads the tokenizer class that the tokenizer "
            "folder names (AutoTokenizer)."
        )
    if r.tf32 is not None:
        notes.append(f"tf32: {str(r.tf32).lower()} applies on NVIDIA GPUs only (it has no effect on CPU).")
    if r.eval_sample_packing is not None and r.eval_sample_packing != r.sample_packing:
        notes.append(
            f"eval_sample_packing: {str(r.eval_sample_packing).lower()} is not used: evaluation rows are packed as "
            f"training rows are (sample_packing: {str(r.sample_packing).lower()}); packed samples are kept apart, "
            "so the eval loss is the same."
        )
    if r.evals_per_epoch and not (r.val_set_size or r.test_datasets):
        notes.append(
            "evals_per_epoch is not used: the recipe has no evaluation data (val_set_size, test_datasets)."
        )
    if r.strict is not None:
        notes.append("strict is not used: cptune always refuses unknown keys.")
    if (r.wandb_entity or r.wandb_name or r.wandb_mode or r.wandb_run_id) and not r.wandb_enabled:
        notes.append(
            "wandb_* keys are not used: W&B logging is on only with wandb_project or use_wandb: true."
        )
    return notes
