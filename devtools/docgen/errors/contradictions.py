"""Troubleshooting entries of the section "Keys that contradict each other"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "Keys that contradict each other"
NOTE: str | None = None
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "bf16-and-fp16",
        SECTION,
        "bf16 and fp16 both on",
        "fp16: bf16 and fp16 are both true; choose one (or neither for fp32).",
        "Set one of them (bf16 on GPUs that have it).",
    ),
    Entry(
        "warmup-twice",
        SECTION,
        "Both warmup_steps and warmup_ratio",
        "warmup_ratio: set either warmup_steps or warmup_ratio, not both.",
        "Keep one of them.",
    ),
    Entry(
        "adam-keys-without-adam",
        SECTION,
        "adam_beta1, adam_beta2 or adam_epsilon with an optimizer that does not use them",
        "adam_beta2: optimizer sgd does not use Adam's betas or epsilon, so adam_beta2 would change nothing",
        "SGD, Adagrad, RMSprop, Adafactor, LOMO and GrokAdamW take no Adam betas or epsilon (the Trainer passes "
        "them to the Adam-family optimizers only). Remove the keys, or pick an Adam-family optimizer "
        "(`adamw_torch`, `adamw_8bit`, ...).",
    ),
    Entry(
        "eval-without-data",
        SECTION,
        "eval_steps without evaluation data",
        "eval_steps: evaluation needs data: set val_set_size or test_datasets.",
        "Set `val_set_size` (a share or a count of the training rows) or `test_datasets`, or remove "
        "`eval_steps`.",
    ),
    Entry(
        "torch-cp-packing",
        SECTION,
        "cp_backend: torch with sample_packing",
        "sample_packing: cp_backend: torch cannot keep packed samples apart",
        "torch's context-parallel attention takes no document mask, so packed samples would attend to "
        "each other. Use `cp_backend: ring-flash-attn`, or `sample_packing: false`.",
    ),
    Entry(
        "option-of-another-backend",
        SECTION,
        "An option of another backend",
        "cp_comm_strategy: applies only to cp_backend: torch; remove it.",
        "Backend options apply to their backend only; remove it or change `cp_backend`.",
    ),
    Entry(
        "resume-and-overwrite",
        SECTION,
        "--resume together with --overwrite",
        "overwrite_output_dir: resume_from_checkpoint continues the earlier run in output_dir, "
        "overwrite_output_dir starts afresh and removes it; set only one of them.",
        "Decide: continue the earlier run (`--resume`) or replace it (`--overwrite`).",
    ),
    Entry(
        "val-set-and-test-datasets",
        SECTION,
        "Both val_set_size and test_datasets",
        "val_set_size: set either val_set_size or test_datasets, not both.",
        "Evaluate on a held-out share of the training data (`val_set_size`) or on your own evaluation data "
        "(`test_datasets`), not both.",
    ),
    Entry(
        "val-set-not-whole",
        SECTION,
        "val_set_size of 1 or more that is not a whole number",
        "val_set_size: 2.5 is 1 or more, so it counts rows and must be a whole number",
        "A `val_set_size` below 1 is a share of the training samples, 1 or more is a count of them: write "
        "`0.05` or `25`, not `2.5`.",
    ),
    Entry(
        "ring-attn-func-other-backend",
        SECTION,
        "ring_attn_func with another cp_backend",
        "ring_attn_func: applies only to cp_backend: ring-flash-attn; remove it.",
        "`ring_attn_func` chooses ring-flash-attn's algorithm; remove it, or use `cp_backend: ring-flash-attn`.",
    ),
    Entry(
        "zigzag-packing",
        SECTION,
        "ring_attn_func: batch_zigzag with sample_packing",
        "ring_attn_func: batch_zigzag cannot keep packed samples apart (it has no document boundaries)",
        "Use `ring_attn_func: varlen_llama3` (the default), which keeps packed samples apart, or "
        "`sample_packing: false`.",
    ),
    Entry(
        "zigzag-bidirectional",
        SECTION,
        "ring_attn_func: batch_zigzag with causal: false",
        "ring_attn_func: batch_zigzag is causal only; use varlen_llama3 with causal: false.",
        "Use `ring_attn_func: varlen_llama3` (the default) for bidirectional attention.",
    ),
    Entry(
        "zigzag-without-bf16",
        SECTION,
        "ring_attn_func: batch_zigzag without bf16",
        "ring_attn_func: batch_zigzag needs bf16: true. ring-flash-attn 0.1.8 computes wrong gradients",
        "Set `bf16: true`, or use `ring_attn_func: varlen_llama3` (the default), which is exact in fp32.",
    ),
    Entry(
        "torch-load-balance-bidirectional",
        SECTION,
        "cp_backend: torch with cp_load_balance and causal: false",
        "cp_load_balance: torch's load balancing reorders tokens for causal attention only",
        "Remove `cp_load_balance` (it is off by default with `causal: false`), or set it to false.",
    ),
    Entry(
        "torch-padding-bidirectional",
        SECTION,
        "cp_backend: torch with pad_to_sequence_len and causal: false",
        "pad_to_sequence_len: with cp_backend: torch and causal: false every token would attend to the padding",
        "torch's context-parallel attention takes no padding mask. Use `cp_backend: ring-flash-attn`, or "
        "`pad_to_sequence_len: false`.",
    ),
    Entry(
        "ulysses-eval-batch-larger",
        SECTION,
        "cp_backend: deepspeed with eval_batch_size above micro_batch_size",
        "eval_batch_size: 4 is more rows than micro_batch_size (1): DeepSpeed's Ulysses module is built for the "
        "training batch's rows and refuses a larger batch.",
        "Evaluate with `eval_batch_size` at or below `micro_batch_size` (the evaluation loss is the same token mean "
        "however the rows are batched), or choose another `cp_backend`.",
    ),
    Entry(
        "deepspeed-option-other-backend",
        SECTION,
        "A DeepSpeed option with another cp_backend",
        "ulysses_attn_implementation: applies only to cp_backend: deepspeed; remove it.",
        "`ulysses_attn_implementation` configures `cp_backend: deepspeed`; remove it or change `cp_backend`. "
        "(`zero_stage` and `deepspeed` run every backend under DeepSpeed's ZeRO, and at `context_parallel_size` 1 "
        "train with ZeRO next to plain data parallelism.)",
    ),
    Entry(
        "ulysses-core-bidirectional",
        SECTION,
        "Ulysses with sdpa or flash-attn core attention and causal: false",
        "ulysses_attn_implementation: sdpa attends causally only here (DeepSpeed's Ulysses wrapper drops "
        "attention masks)",
        "Use `ulysses_attn_implementation: cptune` (the default) for bidirectional attention.",
    ),
    Entry(
        "ulysses-sdpa-packing",
        SECTION,
        "Ulysses with sdpa core attention and sample_packing",
        "sample_packing: ulysses_attn_implementation: sdpa cannot keep packed samples apart",
        "Use `ulysses_attn_implementation: cptune` (the default), which keeps packed samples apart, or "
        "`sample_packing: false`.",
    ),
    Entry(
        "ulysses-flash-packing-batch",
        SECTION,
        "Ulysses with flash-attn core attention, sample_packing and micro_batch_size > 1",
        "micro_batch_size: flash_attention_2 finds packed samples from position_ids only in batches of one row",
        "Use `micro_batch_size: 1` with more `gradient_accumulation_steps`, or "
        "`ulysses_attn_implementation: cptune`.",
    ),
    Entry(
        "lora-targets-empty",
        SECTION,
        "An empty lora_target_modules",
        "lora_target_modules: is empty; list module names or set lora_target_linear: true.",
        "List the module names to adapt (e.g. `[q_proj, v_proj]`), or remove the key to adapt every linear "
        "layer.",
    ),
    Entry(
        "fsdp-version-1",
        SECTION,
        "fsdp_version: 1",
        "fsdp_version: FSDP1 is not supported (transformers deprecates it); use fsdp_version: 2",
        "Set `fsdp_version: 2`; it shards the same model states, and `fsdp_config` takes the same keys.",
    ),
    Entry(
        "fsdp-keys-without-version",
        SECTION,
        "FSDP keys without fsdp_version",
        "dp_shard_size: applies only with fsdp_version: 2 (without FSDP every rank holds the whole model",
        "`fsdp_config`, `dp_shard_size` and `dp_replicate_size` shape FSDP2 sharding. Set `fsdp_version: 2`, "
        "or remove them.",
    ),
    Entry(
        "fsdp-with-deepspeed",
        SECTION,
        "fsdp_version with cp_backend: deepspeed",
        "fsdp_version: cp_backend: deepspeed shards model states with DeepSpeed's ZeRO stages, not FSDP",
        "Use `zero_stage: 3` to shard weights, gradients and optimizer state with DeepSpeed, or another "
        "`cp_backend` with `fsdp_version: 2`.",
    ),
    Entry(
        "qlora-without-4bit",
        SECTION,
        "adapter: qlora without load_in_4bit",
        "adapter: qlora trains a LoRA adapter on a 4-bit base: set load_in_4bit: true",
        "Add `load_in_4bit: true` (QLoRA), or use `adapter: lora` on the full-precision base.",
    ),
    Entry(
        "4bit-without-qlora",
        SECTION,
        "load_in_4bit without adapter: qlora",
        "load_in_4bit: a 4-bit base model is trained through a LoRA adapter: set adapter: qlora",
        "Set `adapter: qlora`, or remove `load_in_4bit` to train on the full-precision base.",
    ),
    Entry(
        "8bit-without-lora",
        SECTION,
        "load_in_8bit with a full fine-tune",
        "load_in_8bit: an 8-bit base model is trained through adapter: lora",
        "8-bit weights are frozen: set `adapter: lora`, or remove `load_in_8bit`.",
    ),
    Entry(
        "bnb-kwargs-without-quantization",
        SECTION,
        "bnb_config_kwargs without a quantized base",
        "bnb_config_kwargs: applies only with load_in_4bit or load_in_8bit; remove it.",
        "Set `load_in_4bit: true` with `adapter: qlora` (or `load_in_8bit`), or remove `bnb_config_kwargs`.",
    ),
    Entry(
        "8bit-with-fsdp2",
        SECTION,
        "An 8-bit base under FSDP2",
        "load_in_8bit: an 8-bit base cannot be trained under FSDP2",
        "Use `load_in_4bit: true` with `adapter: qlora`: FSDP2 shards its 4-bit weights with the others (stored in "
        "the training dtype by default; `bnb_4bit_quant_storage: uint8` keeps them whole on every rank). Or remove `fsdp_version` / `fsdp` and train the 8-bit base with plain "
        "data parallelism.",
    ),
    Entry(
        "mxfp4-not-dequantized",
        SECTION,
        "model_quantization_config: Mxfp4Config without dequantize: true",
        "model_quantization_config_kwargs: model_quantization_config: Mxfp4Config keeps the weights in MXFP4 unless "
        "dequantize is true, and MXFP4 weights cannot be trained",
        "Add `model_quantization_config_kwargs: {dequantize: true}`: the MXFP4 experts of a gpt-oss checkpoint are "
        "then dequantized to the training dtype while loading and trained like the other weights (as Axolotl's "
        "gpt-oss recipes do).",
    ),
    Entry(
        "mxfp4-kwargs-without-config",
        SECTION,
        "model_quantization_config_kwargs without model_quantization_config",
        "model_quantization_config: is not set, but model_quantization_config_kwargs is",
        "Set `model_quantization_config: Mxfp4Config` for a checkpoint stored in MXFP4 (gpt-oss), or remove "
        "`model_quantization_config_kwargs`.",
    ),
    Entry(
        "mxfp4-and-bitsandbytes",
        SECTION,
        "model_quantization_config with load_in_4bit or load_in_8bit",
        "load_in_4bit: the base model is loaded with model_quantization_config: Mxfp4Config (dequantized for "
        "training), so bitsandbytes cannot quantize it too",
        "One quantization at a time: remove `load_in_4bit` / `load_in_8bit` (and `adapter: qlora`) to train the "
        "dequantized MXFP4 model, or remove `model_quantization_config`.",
    ),
    Entry(
        "moe-experts-without-4bit",
        SECTION,
        "quantize_moe_experts without load_in_4bit",
        "quantize_moe_experts: cptune stores a mixture of experts' expert weights in 4 bits only, under QLoRA",
        "Set `load_in_4bit: true` with `adapter: qlora` (the experts are then packed in 4 bits like the linear "
        "layers), or remove `quantize_moe_experts`: with `load_in_8bit` the experts stay in the training dtype, "
        "as `cptune validate`'s memory estimate counts them.",
    ),
    Entry(
        "moe-experts-without-checkpointing",
        SECTION,
        "quantize_moe_experts without gradient checkpointing",
        "quantize_moe_experts: needs gradient_checkpointing: true",
        "Set `gradient_checkpointing: true`. The experts are dequantized as each layer runs; the layer's "
        "recomputation in the backward dequantizes them again, so one layer's dequantized experts exist at a "
        "time. Without it every layer's would be kept for the backward, as much memory as unquantized experts.",
    ),
    Entry(
        "moe-experts-sharded",
        SECTION,
        "quantize_moe_experts with FSDP or DeepSpeed",
        "quantize_moe_experts: 4-bit experts are not built for sharded weights",
        "Train without `fsdp_version` / `fsdp` / `deepspeed` / `zero_stage`: on one GPU, or with data and context "
        "parallelism, where every rank holds the packed experts whole. Or remove `quantize_moe_experts` to shard "
        "the experts in the training dtype.",
    ),
    Entry(
        "fsdp1-list-with-version-1",
        SECTION,
        "Axolotl's fsdp list with fsdp_version: 1",
        "fsdp_version: is 1, but fsdp: [full_shard, auto_wrap] asks for sharding that cptune runs with FSDP2 only",
        "Remove `fsdp_version` (the `fsdp` list implies `fsdp_version: 2`) or set it to 2.",
    ),
    Entry(
        "fsdp1-two-strategies",
        SECTION,
        "Two sharding strategies in Axolotl's fsdp list",
        "fsdp: [full_shard, shard_grad_op] lists 2 sharding strategies; keep one.",
        "Keep `full_shard` (free each layer's gathered weights after its forward, less memory) or "
        "`shard_grad_op` (keep them for the backward, fewer all-gathers).",
    ),
    Entry(
        "fsdp1-no-shard",
        SECTION,
        "fsdp: no_shard (or sharding_strategy: NO_SHARD)",
        "fsdp: no_shard is plain data parallelism (every rank holds the whole model), which cptune runs without "
        "FSDP",
        "Remove `fsdp`, `fsdp_config` and `fsdp_version`: without them cptune trains with plain data parallelism.",
    ),
    Entry(
        "fsdp1-hybrid-without-replicas",
        SECTION,
        "fsdp: hybrid_shard (or HYBRID_SHARD) without dp_replicate_size",
        "fsdp: hybrid_shard shards within a group of ranks and replicates across groups; in cptune's FSDP2 that "
        "is dp_replicate_size",
        "Set `dp_replicate_size` to the number of copies (for example the number of nodes); each copy is sharded "
        "over processes / (dp_replicate_size × context_parallel_size) ranks.",
    ),
    Entry(
        "fsdp1-strategy-disagrees",
        SECTION,
        "fsdp / sharding_strategy / reshard_after_forward disagree",
        "fsdp_config.reshard_after_forward: false disagrees with fsdp: full_shard",
        "`full_shard` (`FULL_SHARD`) is `reshard_after_forward: true`, `shard_grad_op` (`SHARD_GRAD_OP`) is "
        "`false`: keep one of the keys, or make them agree.",
    ),
    Entry(
        "fsdp1-offload-disagrees",
        SECTION,
        "offload in Axolotl's fsdp list with offload_params: false",
        "fsdp_config.offload_params: is false, but fsdp: [full_shard, offload] asks for offload",
        "Remove `offload` from `fsdp` or `offload_params: false` from `fsdp_config`.",
    ),
    Entry(
        "jinja-without-template",
        SECTION,
        "chat_template: jinja without chat_template_jinja",
        "chat_template: jinja needs the template in chat_template_jinja",
        "Give the template's text (or the path of a .jinja file) in `chat_template_jinja`.",
    ),
    Entry(
        "jinja-with-named-template",
        SECTION,
        "chat_template_jinja next to a named chat_template",
        "chat_template_jinja: chat_template: llama3 names another template",
        "Keep one: `chat_template: jinja` with `chat_template_jinja`, or the named template alone.",
    ),
    Entry(
        "lora-extras-without-lora",
        SECTION,
        "lora_modules_to_save or lora_model_dir in a full fine-tune",
        "lora_modules_to_save: applies only with adapter: lora or qlora; remove it.",
        "A full fine-tune trains every module already; remove the key, or set `adapter: lora`.",
    ),
    Entry(
        "unfrozen-with-adapter",
        SECTION,
        "unfrozen_parameters with a LoRA or QLoRA adapter",
        "unfrozen_parameters: selects the parameters of a full fine-tune, but adapter: lora trains a LoRA adapter",
        "Axolotl applies the patterns to the adapter-wrapped model, whose names start with `base_model.model.`, "
        "so its examples' `^model.…` patterns freeze the adapter too. Name whole modules to train next to the "
        "adapter in `lora_modules_to_save`, restrict the adapter with `lora_target_modules`, or remove `adapter` "
        "for a full fine-tune of the selected parameters.",
    ),
    Entry(
        "per-epoch-and-steps",
        SECTION,
        "evals_per_epoch next to eval_steps (or saves_per_epoch next to save_steps)",
        "evals_per_epoch: and eval_steps both set how often (Axolotl's count per epoch, cptune's steps); set one",
        "Keep one of them: Axolotl's per-epoch count, or cptune's steps.",
    ),
    Entry(
        "strategy-steps-without-period",
        SECTION,
        "save_strategy: steps (or eval_strategy: steps) without how often",
        "save_strategy: steps needs how often: set save_steps or saves_per_epoch, or use save_strategy: epoch or no.",
        "`steps` saves (or evaluates) every so many steps: give `save_steps` or `saves_per_epoch` (`eval_steps` or "
        "`evals_per_epoch`), or choose `epoch` or `no`.",
    ),
    Entry(
        "strategy-and-period",
        SECTION,
        "save_strategy: epoch or no next to save_steps (or the same for evaluation)",
        "eval_strategy: epoch and eval_steps both say when (epoch: at the end of each epoch); keep one of them.",
        "`epoch` and `no` fix when on their own; remove the period (`save_steps`, `saves_per_epoch`, `eval_steps`, "
        "`evals_per_epoch`), or use `steps` with it.",
    ),
    Entry(
        "batch-size-not-rows-per-step",
        SECTION,
        "batch_size that is not micro_batch_size x gradient_accumulation_steps",
        "batch_size: 8 is not micro_batch_size x gradient_accumulation_steps (2 x 2 = 4), the rows each process "
        "trains per optimizer step (Axolotl's meaning); set gradient_accumulation_steps: 4, or remove batch_size.",
        "In Axolotl `batch_size` is the rows a process trains per optimizer step. Leave "
        "`gradient_accumulation_steps` unset and cptune sets it to `batch_size / micro_batch_size`, as Axolotl "
        "does; or remove `batch_size`.",
    ),
    Entry(
        "bfloat16-disagrees-with-bf16",
        SECTION,
        "bfloat16 (or float16) that disagrees with bf16 (fp16)",
        "bfloat16: is True but bf16 is False; they are the same setting, set bf16 only.",
        "`bfloat16` and `float16` are Axolotl's other spellings of `bf16` and `fp16`: set `bf16` (or `fp16`) "
        "alone.",
    ),
    Entry(
        "cosine-min-lr-ratio-without-cosine",
        SECTION,
        "cosine_min_lr_ratio with another lr_scheduler than cosine",
        "cosine_min_lr_ratio: shapes the cosine schedule's end, but lr_scheduler is linear; set lr_scheduler: "
        "cosine or remove it.",
        "Axolotl's `cosine_min_lr_ratio` ends the cosine schedule at that share of `learning_rate`; other "
        "schedules have no such end. Set `lr_scheduler: cosine` (its default in cptune), or remove the key.",
    ),
    Entry(
        "dataset-num-proc-disagrees",
        SECTION,
        "dataset_num_proc that disagrees with dataset_processes",
        "dataset_num_proc: is 8 but dataset_processes is 2; they are the same setting, set dataset_processes only.",
        "`dataset_num_proc` is Axolotl's newer name for `dataset_processes` (the tokenization workers): set "
        "`dataset_processes` alone, or keep the Axolotl key by itself.",
    ),
    Entry(
        "deepspeed-with-fsdp",
        SECTION,
        "deepspeed (ZeRO) together with fsdp_version",
        "fsdp_version: shards model states with FSDP2, and deepspeed / zero_stage with DeepSpeed's ZeRO: choose one",
        "Shard with one engine: remove `fsdp_version` to run under DeepSpeed's ZeRO (ring-flash-attn and torch CP "
        "run there too), or remove `deepspeed` and `zero_stage` to shard with FSDP2.",
    ),
    Entry(
        "activation-offloading-without-checkpointing",
        SECTION,
        "activation_offloading without gradient checkpointing",
        "activation_offloading: offloads the layer inputs that gradient checkpointing keeps for the backward "
        "pass; set gradient_checkpointing: true as well.",
        "Add `gradient_checkpointing: true`: offloading moves exactly the inputs that checkpointing keeps.",
    ),
    Entry(
        "tiled-mlp-shards-without-tiled-mlp",
        SECTION,
        "tiled_mlp_num_shards without tiled_mlp",
        "tiled_mlp_num_shards: applies only with tiled_mlp: true",
        "Add `tiled_mlp: true`, or remove `tiled_mlp_num_shards`.",
    ),
    Entry(
        "tp-without-fsdp",
        SECTION,
        "tensor_parallel_size without fsdp_version: 2",
        "tensor_parallel_size: tensor_parallel_size=2 needs fsdp_version: 2",
        "Tensor parallelism runs under FSDP2, which shards the tensor-parallel pieces over the dp_shard × cp "
        "ranks and averages their gradients. Add `fsdp_version: 2`, or remove `tensor_parallel_size`.",
    ),
    Entry(
        "tp-with-adapter",
        SECTION,
        "tensor_parallel_size with a LoRA adapter",
        "adapter: lora with tensor_parallel_size=2 is not supported (LoRA layers are not split over tensor-parallel "
        "ranks)",
        "cptune splits full fine-tunes only: LoRA layers are not split over tensor-parallel ranks. Train the "
        "adapter with `context_parallel_size` and FSDP2 alone, or remove `adapter` for a full fine-tune.",
    ),
    Entry(
        "tp-with-other-backend",
        SECTION,
        "tensor_parallel_size with cp_backend torch or deepspeed",
        "cp_backend: torch with tensor_parallel_size=2 is not supported; use cp_backend: ring-flash-attn, which "
        "rings over each tensor-parallel rank's own heads",
        "Tensor parallelism is built and parity-tested with ring-flash-attn, which rings over each "
        "tensor-parallel rank's own heads. Use `cp_backend: ring-flash-attn` (the default).",
    ),
    Entry(
        "tp-with-deepspeed",
        SECTION,
        "tensor_parallel_size with DeepSpeed",
        "zero_stage: DeepSpeed with tensor_parallel_size=2 is not supported (cptune's tensor parallelism runs "
        "under FSDP2)",
        "cptune's tensor parallelism runs under FSDP2, not DeepSpeed's engine: remove `deepspeed` / "
        "`zero_stage` and set `fsdp_version: 2`.",
    ),
)

DOCUMENTED: tuple[Documented, ...] = ()
