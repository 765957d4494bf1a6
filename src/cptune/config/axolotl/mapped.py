"""Axolotl keys cptune accepts and maps onto its own behaviour (the recipe's :class:`AxolotlKeys` group).

Where a key means something different in cptune, ``cptune validate`` prints a note
(:func:`cptune.config.axolotl.notes.axolotl_notes`); combinations that cannot work are refused by
:mod:`cptune.config.axolotl.rules`, each naming the key and what to do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

# The Trainer's checkpoint and evaluation schedules that Axolotl's save_strategy / eval_strategy name.
Schedule = Literal["steps", "epoch", "no"]


class AxolotlKeys(BaseModel):
    """Key group of the recipe: Axolotl keys cptune accepts and maps onto its own behaviour (``cptune validate``
    notes each)."""

    @model_validator(mode="before")
    @classmethod
    def _accumulation_from_batch_size(cls, data: Any) -> Any:
        # Axolotl's normalize_config: gradient_accumulation_steps = batch_size // micro_batch_size when unset. A
        # batch_size that micro_batch_size does not divide leaves it unset, and the rules refuse the pair.
        batch = data.get("batch_size") if isinstance(data, dict) else None
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            return data
        if data.get("gradient_accumulation_steps") is not None:
            return data
        micro = data.get("micro_batch_size") or 1
        if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1 or batch % micro:
            return data
        return {**data, "gradient_accumulation_steps": batch // micro}

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
        description="flash_attention_2/3, sdpa or a FlashAttention build of the hub's kernels-community (e.g. "
        "kernels-community/vllm-flash-attn3) are accepted; cptune picks the attention from cp_backend (validate "
        "says which runs).",
    )
    flash_attention: bool | None = Field(
        None, description="Accepted like attn_implementation: flash_attention_2."
    )
    sdp_attention: bool | None = Field(None, description="Accepted like attn_implementation: sdpa.")
    gradient_checkpointing_kwargs: dict[str, Any] | None = Field(
        None,
        description="Only `use_reentrant`: cptune checkpoints with use_reentrant: false (true runs so too: the "
        "same gradients up to summation order; validate notes it).",
    )
    evals_per_epoch: int | None = Field(
        None, ge=0, description="Evaluations per epoch (needs evaluation data; instead of eval_steps)."
    )
    saves_per_epoch: int | None = Field(
        None, ge=0, description="Checkpoints per epoch (instead of save_steps)."
    )
    save_strategy: Schedule | None = Field(
        None,
        description="When checkpoints are written (the Trainer's values): `steps` (every save_steps or "
        "saves_per_epoch, one of which it needs), `epoch` (at the end of each epoch) or `no`. Unset: `steps` when "
        "save_steps or saves_per_epoch is set, else `no`.",
    )
    eval_strategy: Schedule | None = Field(
        None,
        description="When the evaluation data is evaluated (the Trainer's values): `steps` (every eval_steps or "
        "evals_per_epoch, one of which it needs), `epoch` (at the end of each epoch) or `no`. Unset: `steps` "
        "when eval_steps or evals_per_epoch is set, else `no`.",
    )
    batch_size: int | None = Field(
        None,
        ge=1,
        description="Axolotl's rows per process per optimizer step, micro_batch_size x "
        "gradient_accumulation_steps: with gradient_accumulation_steps unset it sets it to batch_size / "
        "micro_batch_size; with both set, they must agree.",
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
    cosine_min_lr_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="With lr_scheduler: cosine, decay to this share of learning_rate instead of 0 (the Trainer's "
        "cosine_with_min_lr, Axolotl's schedule to the same values).",
    )
    dataset_num_proc: int | None = Field(
        None, ge=1, description="The same as dataset_processes (Axolotl's newer name): tokenization workers."
    )
    min_sample_len: int | None = Field(
        None, ge=1, description="Drop samples shorter than this many tokens (counted in the data report)."
    )
    strict: bool | None = Field(None, description="Accepted; cptune always validates recipes strictly.")
    shuffle_merged_datasets: bool | None = Field(
        None,
        description="Accepted: cptune stores the prepared rows in the datasets' order (false) and the trainer's "
        "sampler shuffles them every epoch (seeded), so true adds no shuffle of its own.",
    )
    # Axolotl's fused kernels compute what the layers they replace compute (within rounding); cptune runs
    # those layers. Where a kernel drops LoRA inputs differently, cptune.config.axolotl.rules refuses the combination.
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
    # Liger's layer kernels (LigerPlugin's switches) compute the layers they replace, fused; cptune runs the layers.
    liger_rope: bool | None = Field(
        None,
        description="Accepted: cptune runs the model's own rotary embedding (the same function as Liger's).",
    )
    liger_rms_norm: bool | None = Field(
        None,
        description="Accepted: cptune runs the model's own RMSNorm (the same function as Liger's fused kernel; "
        "recompute_norms saves the activation memory it saves).",
    )
    liger_rms_norm_gated: bool | None = Field(
        None,
        description="Accepted: cptune runs the model's own gated RMSNorm (the same function as Liger's).",
    )
    liger_layer_norm: bool | None = Field(
        None, description="Accepted: cptune runs the model's own LayerNorm (the same function as Liger's)."
    )
    liger_glu_activation: bool | None = Field(
        None,
        description="Accepted: cptune runs the model's own gated MLP (the same function as Liger's fused SwiGLU/"
        "GeGLU; tiled_mlp bounds its activation memory).",
    )
    liger_cross_entropy: bool | None = Field(
        None,
        description="Accepted: cptune computes the loss itself (the same token mean; for the chunked loss that "
        "never builds the logits, set cut_cross_entropy or liger_fused_linear_cross_entropy).",
    )
    use_kernels: bool | None = Field(
        None,
        description="Accepted: cptune runs the model's own modules, not the hub's kernels that transformers' "
        "use_kernels swaps in (they compute the same functions; they need the kernels package and the hub).",
    )
    experimental_skip_move_to_device: bool | None = Field(
        None,
        description="Accepted: the Trainer never moves the whole model to the GPU before FSDP2 or DeepSpeed shards "
        "it (what the key asks for); without sharding each GPU holds the whole model, as training it needs.",
    )
    fused_attn_kernel: bool | None = Field(
        None,
        description="Accepted: cptune runs the model's own q/k RMSNorm and RoPE and the backend's attention, the "
        "same result without Axolotl's fused Triton kernel (which agrees within bf16 rounding).",
    )

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


def share_of_run(per_epoch: int, epochs: float) -> float | None:
    """Every 1/(per_epoch × epochs) of the run, as Axolotl: None when that is the whole run or more."""
    share = 1 / (per_epoch * epochs)
    return share if share < 1 else None
