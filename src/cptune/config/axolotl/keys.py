"""Axolotl keys that cptune recognises but does not support, each with what to do instead.

A recipe brought over from Axolotl should fail with a message that says so, not
with a generic "unknown key". Each entry maps the key to its one-line advice. Any
other key of Axolotl's schema (:mod:`cptune.config.axolotl.schema`) that cptune
has no field for is refused with :data:`NO_COUNTERPART`; an empty (null) value,
or ``false`` for an Axolotl switch, is accepted as "not set".
"""

from __future__ import annotations

_QUANTIZED = "GPTQ-quantized models are not supported; use load_in_4bit with adapter: qlora (bitsandbytes)."
_ATTENTION = "cptune chooses the attention implementation from cp_backend; remove it."
_HUB = "pushing to the Hugging Face Hub is not supported; upload output_dir yourself."
_KERNELS = "fused kernels from Axolotl's integrations are not supported; remove it."
_MLFLOW = (
    "MLflow logging is not supported (cptune does not install MLflow, a heavy dependency); use W&B "
    "(wandb_project, wandb_mode: offline works without network) or report_to: tensorboard."
)

NO_COUNTERPART = (
    "it has no counterpart in cptune; remove it (an empty value or false is accepted as not set)."
)
"""Advice for an Axolotl key of :mod:`cptune.config.axolotl.schema` that is not listed below."""

UNSUPPORTED_RECIPE_KEYS: dict[str, str] = {
    "sequence_parallel_degree": "Axolotl's older name for context_parallel_size; rename it.",
    "evaluation_strategy": "Axolotl's older name for eval_strategy; rename it.",
    "gptq": _QUANTIZED,
    "xformers_attention": _ATTENTION,
    "flex_attention": _ATTENTION,
    "eager_attention": _ATTENTION,
    "s2_attention": _ATTENTION,
    "flash_attn_cross_entropy": _KERNELS,
    "flash_attn_rms_norm": _KERNELS,
    "flash_attn_fuse_qkv": _KERNELS,
    "flash_attn_fuse_mlp": _KERNELS,
    "unsloth_lora_mlp": _KERNELS,
    "unsloth_lora_qkv": _KERNELS,
    "unsloth_lora_o": _KERNELS,
    "use_mlflow": _MLFLOW,
    "mlflow_tracking_uri": _MLFLOW,
    "mlflow_experiment_name": _MLFLOW,
    "mlflow_run_name": _MLFLOW,
    "hf_mlflow_log_artifacts": _MLFLOW,
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "push_dataset_to_hub": _HUB,
    "hf_use_auth_token": "cptune reads hub credentials from the environment (HF_TOKEN); remove it.",
    "lora_fan_in_fan_out": "not needed for the supported architectures; remove it.",
    "peft_use_dora": "DoRA is not supported; remove it.",
    "peft_use_rslora": "rsLoRA is not supported; remove it.",
    "group_by_length": "length grouping is not supported; use sample_packing: true.",
    "sample_packing_eff_est": "cptune packs exactly and reports the efficiency; remove it.",
    "total_num_tokens": "cptune counts tokens itself; remove it.",
    "torch_compile": "torch.compile is not supported yet; remove it.",
    "early_stopping_patience": "early stopping is not supported yet; remove it.",
    "auto_resume_from_checkpoints": (
        "use resume_from_checkpoint: true (or `cptune train --resume`), which continues from the newest "
        "complete checkpoint in output_dir."
    ),
    "neftune_noise_alpha": "NEFTune is not supported; remove it.",
    "noisy_embedding_alpha": "NEFTune is not supported; remove it.",
    "default_system_message": "not supported; put the system message in the data.",
    "gpu_memory_limit": "not supported; remove it.",
    "debug": "use `cptune validate` to see the resolved recipe; remove it.",
    "local_rank": "set by the launcher, not the recipe; remove it.",
    "base_model_config": "use tokenizer_config for a separate tokenizer; the model's config comes from base_model.",
}

UNSUPPORTED_DATASET_KEYS: dict[str, str] = {
    "conversation": "use type: chat_template.",
    "shards": "sharding datasets is not supported; remove it.",
    "chat_template": "set chat_template at the top level of the recipe.",
}

_FSDP1_ONLY = "an FSDP1 setting with no FSDP2 counterpart; remove it."

UNSUPPORTED_FSDP_KEYS: dict[str, str] = {
    "backward_prefetch": _FSDP1_ONLY,
    "forward_prefetch": _FSDP1_ONLY,
    "min_num_params": "size-based wrapping is not supported: every decoder layer is its own FSDP unit; remove it.",
    "version": "it differs from fsdp_version at the top level of the recipe; keep one of them.",
    "activation_checkpointing_reentrant": "cptune's gradient checkpointing is non-reentrant; remove it.",
}
"""Keys Axolotl or accelerate accept inside ``fsdp_config`` that cptune does not (after a leading ``fsdp_``)."""
