"""Catalogue cases of the section "Keys that contradict each other" (their text: devtools/docgen/errors/contradictions.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import DELETE, Case
from tests.reliability.catalogue.setups import DEEPSPEED_CP

CASES: tuple[Case, ...] = (
    Case(
        "bf16-and-fp16",
        keys={"bf16": True, "fp16": True},
    ),
    Case(
        "warmup-twice",
        keys={"warmup_steps": 10, "warmup_ratio": 0.1},
    ),
    Case(
        "adam-keys-without-adam",
        keys={"optimizer": "sgd", "adam_beta2": 0.95},
    ),
    Case(
        "eval-without-data",
        keys={"eval_steps": 5},
    ),
    Case(
        "torch-cp-packing",
        keys={"context_parallel_size": 2, "cp_backend": "torch"},
    ),
    Case(
        "option-of-another-backend",
        keys={"cp_comm_strategy": "alltoall"},
    ),
    Case(
        "resume-and-overwrite",
        args=("--resume", "--overwrite"),
    ),
    Case(
        "val-set-and-test-datasets",
        setup=lambda ws: {"val_set_size": 0.1, "test_datasets": [{"path": str(ws.data / "train.jsonl")}]},
    ),
    Case(
        "val-set-not-whole",
        keys={"val_set_size": 2.5},
    ),
    Case(
        "ring-attn-func-other-backend",
        keys={"cp_backend": "torch", "ring_attn_func": "varlen_llama3", "sample_packing": False},
    ),
    Case(
        "zigzag-packing",
        keys={"context_parallel_size": 2, "ring_attn_func": "batch_zigzag", "bf16": True},
    ),
    Case(
        "zigzag-bidirectional",
        keys={
            "context_parallel_size": 2,
            "ring_attn_func": "batch_zigzag",
            "bf16": True,
            "sample_packing": False,
            "causal": False,
        },
    ),
    Case(
        "zigzag-without-bf16",
        keys={"context_parallel_size": 2, "ring_attn_func": "batch_zigzag", "sample_packing": False},
    ),
    Case(
        "torch-load-balance-bidirectional",
        keys={
            "context_parallel_size": 2,
            "cp_backend": "torch",
            "sample_packing": False,
            "causal": False,
            "cp_load_balance": True,
        },
    ),
    Case(
        "torch-padding-bidirectional",
        keys={
            "context_parallel_size": 2,
            "cp_backend": "torch",
            "sample_packing": False,
            "causal": False,
            "pad_to_sequence_len": True,
        },
    ),
    Case(
        "ulysses-eval-batch-larger",
        keys={**DEEPSPEED_CP, "eval_batch_size": 4, "micro_batch_size": 1},
    ),
    Case(
        "deepspeed-option-other-backend",
        keys={"context_parallel_size": 2, "ulysses_attn_implementation": "sdpa"},
    ),
    Case(
        "ulysses-core-bidirectional",
        keys={
            **DEEPSPEED_CP,
            "ulysses_attn_implementation": "sdpa",
            "sample_packing": False,
            "causal": False,
        },
    ),
    Case(
        "ulysses-sdpa-packing",
        keys={**DEEPSPEED_CP, "ulysses_attn_implementation": "sdpa"},
    ),
    Case(
        "ulysses-flash-packing-batch",
        keys={**DEEPSPEED_CP, "ulysses_attn_implementation": "flash_attention_2"},
    ),
    Case(
        "lora-targets-empty",
        keys={"lora_target_modules": []},
    ),
    Case(
        "fsdp-version-1",
        keys={"fsdp_version": 1},
    ),
    Case(
        "fsdp-keys-without-version",
        keys={"dp_shard_size": 2},
    ),
    Case(
        "fsdp-with-deepspeed",
        keys={**DEEPSPEED_CP, "fsdp_version": 2},
    ),
    Case(
        "qlora-without-4bit",
        keys={"adapter": "qlora"},
    ),
    Case(
        "4bit-without-qlora",
        keys={"load_in_4bit": True},
    ),
    Case(
        "8bit-without-lora",
        keys={"load_in_8bit": True, "adapter": DELETE},
    ),
    Case(
        "bnb-kwargs-without-quantization",
        keys={"bnb_config_kwargs": {"bnb_4bit_quant_type": "fp4"}},
    ),
    Case(
        "8bit-with-fsdp2",
        keys={"adapter": "lora", "load_in_8bit": True, "fsdp_version": 2},
    ),
    Case(
        "mxfp4-not-dequantized",
        keys={"model_quantization_config": "Mxfp4Config"},
    ),
    Case(
        "mxfp4-kwargs-without-config",
        keys={"model_quantization_config_kwargs": {"dequantize": True}},
    ),
    Case(
        "mxfp4-and-bitsandbytes",
        keys={
            "model_quantization_config": "Mxfp4Config",
            "model_quantization_config_kwargs": {"dequantize": True},
            "adapter": "qlora",
            "load_in_4bit": True,
        },
    ),
    Case(
        "moe-experts-without-4bit",
        keys={"load_in_8bit": True, "gradient_checkpointing": True, "quantize_moe_experts": True},
    ),
    Case(
        "moe-experts-without-checkpointing",
        keys={"adapter": "qlora", "load_in_4bit": True, "quantize_moe_experts": True},
    ),
    Case(
        "moe-experts-sharded",
        keys={
            "adapter": "qlora",
            "load_in_4bit": True,
            "gradient_checkpointing": True,
            "quantize_moe_experts": True,
            "fsdp_version": 2,
        },
    ),
    Case(
        "fsdp1-list-with-version-1",
        keys={"fsdp": ["full_shard", "auto_wrap"], "fsdp_version": 1},
    ),
    Case(
        "fsdp1-two-strategies",
        keys={"fsdp": ["full_shard", "shard_grad_op"]},
    ),
    Case(
        "fsdp1-no-shard",
        keys={"fsdp": "no_shard"},
    ),
    Case(
        "fsdp1-hybrid-without-replicas",
        keys={"fsdp": ["hybrid_shard", "auto_wrap"]},
    ),
    Case(
        "fsdp1-strategy-disagrees",
        keys={"fsdp": ["full_shard", "auto_wrap"], "fsdp_config": {"fsdp_reshard_after_forward": False}},
    ),
    Case(
        "fsdp1-offload-disagrees",
        keys={"fsdp": ["full_shard", "offload"], "fsdp_config": {"offload_params": False}},
    ),
    Case(
        "jinja-without-template",
        keys={"chat_template": "jinja"},
    ),
    Case(
        "jinja-with-named-template",
        keys={"chat_template": "llama3", "chat_template_jinja": "{{ messages }}"},
    ),
    Case(
        "lora-extras-without-lora",
        keys={"adapter": DELETE, "lora_modules_to_save": ["lm_head"]},
    ),
    Case(
        "unfrozen-with-adapter",
        keys={"unfrozen_parameters": ["^lm_head"]},
    ),
    Case(
        "per-epoch-and-steps",
        keys={"evals_per_epoch": 4, "eval_steps": 10, "val_set_size": 0.1},
    ),
    Case(
        "strategy-steps-without-period",
        keys={"save_strategy": "steps"},
    ),
    Case(
        "strategy-and-period",
        keys={"eval_strategy": "epoch", "eval_steps": 10, "val_set_size": 0.1},
    ),
    Case(
        "batch-size-not-rows-per-step",
        keys={"batch_size": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 2},
    ),
    Case(
        "bfloat16-disagrees-with-bf16",
        keys={"bfloat16": True},
    ),
    Case(
        "cosine-min-lr-ratio-without-cosine",
        keys={"lr_scheduler": "linear", "cosine_min_lr_ratio": 0.1},
    ),
    Case(
        "dataset-num-proc-disagrees",
        keys={"dataset_num_proc": 8, "dataset_processes": 2},
    ),
    Case(
        "deepspeed-with-fsdp",
        keys={"context_parallel_size": 2, "deepspeed": "zero3.json", "fsdp_version": 2},
    ),
    Case(
        "activation-offloading-without-checkpointing",
        keys={"activation_offloading": True},
    ),
    Case(
        "tiled-mlp-shards-without-tiled-mlp",
        keys={"tiled_mlp_num_shards": 4},
    ),
    Case(
        "tp-without-fsdp",
        keys={"tensor_parallel_size": 2, "context_parallel_size": 2, "adapter": DELETE},
    ),
    Case(
        "tp-with-adapter",
        keys={"tensor_parallel_size": 2, "context_parallel_size": 2, "fsdp_version": 2},
    ),
    Case(
        "tp-with-other-backend",
        keys={
            "tensor_parallel_size": 2,
            "context_parallel_size": 2,
            "fsdp_version": 2,
            "adapter": DELETE,
            "cp_backend": "torch",
            "sample_packing": False,
        },
    ),
    Case(
        "tp-with-deepspeed",
        keys={"tensor_parallel_size": 2, "context_parallel_size": 2, "zero_stage": 2, "adapter": DELETE},
    ),
)
