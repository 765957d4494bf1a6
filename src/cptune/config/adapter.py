"""The recipe's keys of the adapter: LoRA, and the quantized base model a QLoRA adapter trains on."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from cptune.config.base import Frozen, one_or_many

TorchDtypeName = Literal["bfloat16", "float16", "float32"]


class AdapterKeys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: the LoRA adapter's kind, rank and targets."""

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

    @field_validator("lora_target_modules", mode="before")
    @classmethod
    def _many_lora_target_modules(cls, value: Any) -> Any:
        return one_or_many(value)

    @property
    def is_lora(self) -> bool:
        """A LoRA adapter is trained (on a full-precision base, or on a quantized one: qlora, load_in_8bit)."""
        return self.adapter in ("lora", "qlora")


class AdapterExtraKeys(BaseModel):
    """Key group of the recipe: LoRA settings beyond the rank and targets (Axolotl has them too)."""

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
        return one_or_many(value)


class BnbConfig(Frozen):
    """How bitsandbytes quantizes the base model (Axolotl's ``bnb_config_kwargs``)."""

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
        return one_or_many(value)


class Mxfp4Options(Frozen):
    """transformers' ``Mxfp4Config`` arguments (Axolotl's ``model_quantization_config_kwargs``)."""

    dequantize: bool = Field(
        False,
        description="Dequantize the MXFP4 expert weights to the training dtype while loading; cptune trains only "
        "dequantized weights, so this must be true.",
    )
    modules_to_not_convert: tuple[str, ...] | None = Field(
        None,
        description="Modules transformers keeps out of MXFP4 when it quantizes; passed on as given, it changes "
        "nothing in a dequantized load (every tensor stored in MXFP4 is dequantized).",
    )

    @field_validator("modules_to_not_convert", mode="before")
    @classmethod
    def _many_modules_to_not_convert(cls, value: Any) -> Any:
        return one_or_many(value)


# The one transformers quantization config cptune loads a checkpoint with (Axolotl also names FineGrainedFP8Config).
MXFP4_CONFIG = "Mxfp4Config"


class QuantizationKeys(BaseModel):
    """Key group of the recipe: a base model quantized with bitsandbytes under a LoRA adapter (QLoRA), and a
    checkpoint stored in MXFP4 that is loaded dequantized."""

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
    quantize_moe_experts: bool = Field(
        False,
        description="With load_in_4bit, also store a mixture of experts' expert weights (the 3D tensors of its "
        "experts modules, which bitsandbytes' linear layers leave in the training dtype) in 4 bits, with "
        "bnb_config_kwargs' quant type and double quantization, dequantized as each layer runs; the experts stay "
        "frozen and take no LoRA adapter (without the key, targets that name the MLP projections, or all-linear, "
        "adapt the experts too). Needs adapter: qlora and gradient_checkpointing (the backward dequantizes a "
        "layer's experts again instead of keeping them); not with FSDP or DeepSpeed.",
    )

    # --- checkpoint stored in MXFP4 (gpt-oss) -----------------------------------
    model_quantization_config: Literal["Mxfp4Config"] | None = Field(
        None,
        description="`Mxfp4Config`: the base model is a checkpoint stored in MXFP4 (gpt-oss's experts: 4-bit "
        "blocks with a shared scale per 32 values), loaded dequantized to the training dtype and trained "
        "like any other (needs model_quantization_config_kwargs: {dequantize: true}).",
    )
    model_quantization_config_kwargs: Mxfp4Options | None = Field(
        None,
        description="Arguments of transformers' Mxfp4Config: `dequantize` (must be true: cptune trains the "
        "dequantized weights) and `modules_to_not_convert`.",
    )

    @field_validator("model_quantization_config", mode="before")
    @classmethod
    def _only_mxfp4(cls, value: Any) -> Any:
        if isinstance(value, str) and value != MXFP4_CONFIG:
            raise ValueError(
                f"cptune loads quantized checkpoints only with {MXFP4_CONFIG} (gpt-oss's MXFP4 weights, "
                f"dequantized for training), not '{value}'. Set model_quantization_config: {MXFP4_CONFIG}, "
                "or remove it to load the checkpoint as it is stored"
            )
        return value

    @property
    def is_quantized(self) -> bool:
        """The base is quantized by bitsandbytes while loading (load_in_4bit, load_in_8bit)."""
        return self.load_in_4bit or self.load_in_8bit

    @property
    def dequantizes_mxfp4(self) -> bool:
        """The base is an MXFP4 checkpoint loaded dequantized (model_quantization_config: Mxfp4Config)."""
        return self.model_quantization_config == MXFP4_CONFIG
