"""What ``cptune validate`` (and the start of a run) says where an accepted Axolotl key means something else."""

from __future__ import annotations

from cptune.config.axolotl.fsdp1 import HYBRID, RESHARD, written
from cptune.config.recipe import Recipe

_LORA_KERNEL_KEYS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")
_LIGER_LAYER_KEYS = (
    "liger_rope",
    "liger_rms_norm",
    "liger_rms_norm_gated",
    "liger_layer_norm",
    "liger_glu_activation",
    "liger_cross_entropy",
)


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
    if (r.gradient_checkpointing_kwargs or {}).get("use_reentrant") is True:
        notes.append(
            "gradient_checkpointing_kwargs: use_reentrant: true runs as use_reentrant: false, cptune's only "
            "checkpointing (the reentrant variant recomputes without the step's CP metadata): the same gradients "
            "up to summation order."
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
    if r.eval_strategy in ("steps", "epoch") and not r.has_eval_data:
        notes.append(
            f"eval_strategy: {r.eval_strategy} is not used: the recipe has no evaluation data (val_set_size, "
            "test_datasets)."
        )
    if r.fsdp_config is not None and r.fsdp_config.state_dict_type == "FULL_STATE_DICT":
        notes.append(
            "fsdp_config.state_dict_type: FULL_STATE_DICT applies to the final model only: cptune gathers it (or "
            "the adapter) into a standard Hugging Face folder in output_dir, as Axolotl does, but always writes "
            "checkpoints sharded (each rank its own part; resume with the same number of processes)."
        )
    notes += fsdp1_notes(r)
    if r.activation_offloading in ("legacy", "hidden_states"):
        notes.append(
            f"activation_offloading: {r.activation_offloading} runs cptune's own offloading: the layer inputs that "
            "gradient checkpointing keeps go to pinned host memory and come back on a side stream (exact)."
        )
    kernels = [k for k in _LORA_KERNEL_KEYS if getattr(r, k)]
    if kernels:
        notes.append(
            f"{', '.join(kernels)}: cptune runs peft's LoRA layers: the same result, without Axolotl's fused "
            "kernels." + ("" if r.is_lora else " (They apply to LoRA adapters only, in Axolotl too.)")
        )
    liger = [k for k in _LIGER_LAYER_KEYS if getattr(r, k)]
    if liger:
        notes.append(
            f"{', '.join(liger)}: cptune runs the model's own layers and its own loss: the same functions, without "
            "Liger's fused kernels (recompute_norms, tiled_mlp and cut_cross_entropy are cptune's memory savers)."
        )
    if r.fused_attn_kernel:
        notes.append(
            "fused_attn_kernel: cptune runs the model's own q/k RMSNorm and RoPE and the backend's attention: the "
            "same result, without Axolotl's fused kernel."
        )
    if r.use_kernels:
        notes.append(
            "use_kernels: cptune runs the model's own modules, not the hub's kernels (the same functions, without "
            "the kernels package or the hub)."
        )
    if r.experimental_skip_move_to_device:
        notes.append(
            "experimental_skip_move_to_device: the Trainer never moves the whole model to a GPU before FSDP2 or "
            "DeepSpeed shards it; without either, each GPU holds the whole model, as plain data parallelism needs."
        )
    if r.strict is not None:
        notes.append("strict is not used: cptune always refuses unknown keys.")
    if r.shuffle_merged_datasets:
        notes.append(
            "shuffle_merged_datasets: true adds no shuffle: cptune stores the prepared rows in the datasets' order and "
            "the trainer's sampler shuffles them every epoch (seeded)."
        )
    notes += data_notes(r)
    if (r.wandb_entity or r.wandb_name or r.wandb_mode or r.wandb_run_id) and not r.wandb_enabled:
        notes.append(
            "wandb_* keys are not used: W&B logging is on only with wandb_project or use_wandb: true."
        )
    return notes


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
            f"fsdp: {written(options)} is Axolotl's FSDP1 form; cptune runs it with FSDP2: fsdp_version: 2, "
            f"reshard_after_forward: {str(resolved.reshard_after_forward).lower()}, offload_params: "
            f"{str(resolved.offload_params).lower()}; {wrap}."
        )
    config = r.fsdp_config
    if config is None:
        return notes
    if config.sharding_strategy is not None and config.sharding_strategy != "NO_SHARD":
        hybrid = ", one copy per dp_replicate_size group" if config.sharding_strategy in HYBRID else ""
        notes.append(
            f"fsdp_config.sharding_strategy: {config.sharding_strategy} is FSDP1's; with FSDP2 it is "
            f"reshard_after_forward: {str(RESHARD[config.sharding_strategy]).lower()}{hybrid}."
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


# Named chat templates whose cptune rendering differs from Axolotl's template of the same name.
_TEMPLATE_DIFFERENCES = {
    "mistral_v2v3": "writes a system message before the first user message; Axolotl's template writes it only "
    "into a user message that ends the conversation, so in training rows (which end with an answer) it drops it",
    "mistral_v3_tekken": "writes a system message before the first user message; Axolotl's template writes it "
    "only into a user message that ends the conversation, so in training rows (which end with an answer) it drops it",
    "gemma": "writes a system message before the first user message; Axolotl's gemma template refuses a system "
    "message",
}


def data_notes(r: Recipe) -> list[str]:
    """Where the recipe's data would be tokenized or trained differently from Axolotl, one line each."""
    notes = []
    if r.chat_template in _TEMPLATE_DIFFERENCES and any(d.row_format == "chat_template" for d in r.datasets):
        notes.append(f"chat_template: {r.chat_template} {_TEMPLATE_DIFFERENCES[r.chat_template]}.")
    chunked = [
        f"{key}[{i}]"
        for key, entries in (("datasets", r.datasets), ("test_datasets", r.test_datasets or ()))
        for i, d in enumerate(entries)
        if d.row_format == "completion"
    ]
    if chunked and r.excess_length_strategy != "drop":
        notes.append(
            f"excess_length_strategy: {r.excess_length_strategy} does not apply to {', '.join(chunked)}: completion "
            "rows longer than sequence_len are cut into sequence_len pieces, as Axolotl cuts them."
        )
    return notes
