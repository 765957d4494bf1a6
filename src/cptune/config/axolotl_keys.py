"""Axolotl keys that cptune recognises but does not support.

A recipe brought over from Axolotl should fail with a message that says so, not
with a generic "unknown key". Each entry maps the key to what the user should do
instead (an empty hint means there is no cptune equivalent).
"""

from __future__ import annotations

_QUANTIZED = "quantized base models (QLoRA, 8-bit) are not supported by cptune yet; remove it."
_ATTENTION = "cptune chooses the attention implementation from cp_backend; remove it."
_WANDB = "Weights & Biases logging is not supported; use report_to: tensorboard."
_HUB = "pushing to the Hugging Face Hub is not supported; upload output_dir yourself."
_KERNELS = "fused kernels from Axolotl's integrations are not supported; remove it."

UNSUPPORTED_RECIPE_KEYS: dict[str, str] = {
    "sequence_parallel_degree": "Axolotl's older name for context_parallel_size; rename it.",
    "revision_of_model": "cptune calls it model_revision; rename it.",
    "batch_size": "set micro_batch_size and gradient_accumulation_steps instead; remove it.",
    "tf32": "TF32 is not configurable in cptune (torch's default applies); remove it.",
    "gradient_checkpointing_kwargs": "cptune checkpoints with use_reentrant: false; remove it.",
    "load_in_8bit": _QUANTIZED,
    "load_in_4bit": _QUANTIZED,
    "bnb_config_kwargs": _QUANTIZED,
    "gptq": _QUANTIZED,
    "flash_attention": _ATTENTION,
    "sdp_attention": _ATTENTION,
    "xformers_attention": _ATTENTION,
    "flex_attention": _ATTENTION,
    "eager_attention": _ATTENTION,
    "s2_attention": _ATTENTION,
    "flash_attn_cross_entropy": _KERNELS,
    "flash_attn_rms_norm": _KERNELS,
    "flash_attn_fuse_qkv": _KERNELS,
    "flash_attn_fuse_mlp": _KERNELS,
    "liger_rope": _KERNELS,
    "liger_rms_norm": _KERNELS,
    "liger_glu_activation": _KERNELS,
    "unsloth_lora_mlp": _KERNELS,
    "unsloth_lora_qkv": _KERNELS,
    "unsloth_lora_o": _KERNELS,
    "fsdp": "Axolotl's FSDP1 switch; shard with FSDP2 instead: fsdp_version: 2 (settings under fsdp_config).",
    "tensor_parallel_size": "tensor parallelism is not supported; shard model states with fsdp_version: 2.",
    "wandb_project": _WANDB,
    "wandb_entity": _WANDB,
    "wandb_name": _WANDB,
    "wandb_watch": _WANDB,
    "wandb_log_model": _WANDB,
    "wandb_run_id": _WANDB,
    "mlflow_tracking_uri": "MLflow logging is not supported; use report_to: tensorboard.",
    "use_tensorboard": "use report_to: tensorboard.",
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "push_dataset_to_hub": _HUB,
    "hf_use_auth_token": "cptune reads hub credentials from the environment (HF_TOKEN); remove it.",
    "special_tokens": "adding or changing special tokens is not supported; prepare the tokenizer beforehand.",
    "tokens": "adding tokens is not supported; prepare the tokenizer beforehand.",
    "rl": "preference and RL training (DPO, GRPO, ...) is not supported; cptune does supervised fine-tuning.",
    "lora_model_dir": "loading an existing adapter is not supported yet; remove it.",
    "lora_fan_in_fan_out": "not needed for the supported architectures; remove it.",
    "lora_modules_to_save": "training extra modules next to LoRA is not supported yet; remove it.",
    "peft_use_dora": "DoRA is not supported; remove it.",
    "peft_use_rslora": "rsLoRA is not supported; remove it.",
    "group_by_length": "length grouping is not supported; use sample_packing: true.",
    "eval_sample_packing": "evaluation data is packed exactly like training data; remove it.",
    "sample_packing_eff_est": "cptune packs exactly and reports the efficiency; remove it.",
    "total_num_tokens": "cptune counts tokens itself; remove it.",
    "torch_compile": "torch.compile is not supported yet; remove it.",
    "evals_per_epoch": "use eval_steps.",
    "saves_per_epoch": "use save_steps.",
    "eval_batch_size": "evaluation uses micro_batch_size; remove it.",
    "early_stopping_patience": "early stopping is not supported yet; remove it.",
    "auto_resume_from_checkpoints": (
        "use resume_from_checkpoint: true (or `cptune train --resume`), which continues from the newest "
        "complete checkpoint in output_dir."
    ),
    "neftune_noise_alpha": "NEFTune is not supported; remove it.",
    "noisy_embedding_alpha": "NEFTune is not supported; remove it.",
    "chat_template_jinja": "custom Jinja templates are not supported yet; use chat_template: chatml or the tokenizer's.",
    "default_system_message": "not supported; put the system message in the data.",
    "shuffle_merged_datasets": "datasets are always shuffled by the trainer's sampler; remove it.",
    "dataset_exact_deduplication": "deduplication is not supported; deduplicate the data beforehand.",
    "gpu_memory_limit": "not supported; remove it.",
    "strict": "cptune always validates strictly; remove it.",
    "debug": "use `cptune validate` to see the resolved recipe; remove it.",
    "local_rank": "set by the launcher, not the recipe; remove it.",
    "loss_watchdog_threshold": "not supported; remove it.",
    "loss_watchdog_patience": "not supported; remove it.",
    "base_model_config": "use tokenizer_config for a separate tokenizer; the model's config comes from base_model.",
    "tokenizer_type": "the tokenizer class comes from the tokenizer folder; remove it.",
    "model_type": "the model class comes from base_model's config; remove it.",
}

UNSUPPORTED_DATASET_KEYS: dict[str, str] = {
    "ds_type": "the file format is taken from the file extension; remove it.",
    "conversation": "use type: chat_template.",
    "shards": "sharding datasets is not supported; remove it.",
    "message_property_mappings": "use message_field_role and message_field_content.",
    "chat_template": "set chat_template at the top level of the recipe.",
}

_FSDP1_ONLY = "an FSDP1 setting with no FSDP2 counterpart; remove it."

UNSUPPORTED_FSDP_KEYS: dict[str, str] = {
    "sharding_strategy": (
        "an FSDP1 setting; with FSDP2 use reshard_after_forward (true: FULL_SHARD, false: SHARD_GRAD_OP), and "
        "dp_replicate_size at the top level for HYBRID_SHARD."
    ),
    "backward_prefetch": _FSDP1_ONLY,
    "forward_prefetch": _FSDP1_ONLY,
    "use_orig_params": _FSDP1_ONLY,
    "sync_module_states": _FSDP1_ONLY,
    "limit_all_gathers": _FSDP1_ONLY,
    "min_num_params": "size-based wrapping is not supported: every decoder layer is its own FSDP unit; remove it.",
    "cpu_ram_efficient_loading": (
        "not supported yet: every process loads the base model before it is sharded, so the host needs memory "
        "for one copy per process on the node; remove it."
    ),
    "version": "set fsdp_version at the top level of the recipe.",
    "activation_checkpointing_reentrant": "cptune's gradient checkpointing is non-reentrant; remove it.",
}
"""Keys Axolotl or accelerate accept inside ``fsdp_config`` that cptune does not (after a leading ``fsdp_``)."""
