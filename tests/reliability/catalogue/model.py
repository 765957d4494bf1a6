"""Catalogue cases of the section "Model, tokenizer and processes" (their text: devtools/docgen/errors/model.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import DELETE, Case
from tests.reliability.catalogue.setups import (
    _afmoe_model,
    _bloom_model,
    _dropout_model,
    _hidden_dropout_model,
    _llama4_temperature_model,
    _llama_like,
    _lora_model_dir_missing,
    _model_not_causal_lm,
    _model_with_a_smaller_vocabulary,
    _model_with_truncated_weights,
    _model_without_weights,
    _saved_model,
    _short_convolution_model,
    _sinks_model,
    _sliding_window_model,
    _softcapping_model,
    _tokenizer_without_pad_or_eos,
)

CASES: tuple[Case, ...] = (
    Case(
        "model-path-unknown",
        setup=lambda ws: {"base_model": str(ws.root / "no-such-model")},
    ),
    Case(
        "model-without-weights",
        setup=_model_without_weights,
    ),
    Case(
        "model-weights-truncated",
        setup=_model_with_truncated_weights,
    ),
    Case(
        "model-not-causal-lm",
        setup=_model_not_causal_lm,
    ),
    Case(
        "tokenizer-of-another-model",
        setup=_model_with_a_smaller_vocabulary,
    ),
    Case(
        "tokenizer-path-unknown",
        setup=lambda ws: {"tokenizer_config": str(ws.root / "no-such-tokenizer")},
    ),
    Case(
        "cp-not-dividing-world",
        keys={"context_parallel_size": 2},
        args=("--nproc-per-node", "3"),
        subprocess=True,
    ),
    Case(
        "nproc-zero",
        args=("--nproc-per-node", "0"),
    ),
    Case(
        "cp-exceeds-sequence",
        keys={"context_parallel_size": 4, "sequence_len": 2},
    ),
    Case(
        "heads-k-stride",
        keys={"context_parallel_size": 2, "heads_k_stride": 3},
    ),
    Case(
        "ulysses-heads",
        keys={"context_parallel_size": 3, "cp_backend": "deepspeed"},
        args=("--nproc-per-node", "3"),
    ),
    Case(
        "dp-replicate-not-dividing",
        keys={"fsdp_version": 2, "dp_replicate_size": 2, "context_parallel_size": 2},
        args=("--nproc-per-node", "6"),
    ),
    Case(
        "dp-replicate-without-shard",
        keys={"fsdp_version": 2, "dp_replicate_size": 2, "context_parallel_size": 2},
    ),
    Case(
        "dp-shard-not-matching",
        keys={"fsdp_version": 2, "dp_shard_size": 2, "context_parallel_size": 2},
        args=("--nproc-per-node", "2"),
    ),
    Case(
        "model-not-attention-interface",
        keys={"context_parallel_size": 2},
        setup=_bloom_model,
    ),
    Case(
        "model-not-attention-interface-bidirectional",
        keys={"causal": False},
        setup=_bloom_model,
    ),
    Case(
        "model-sliding-window",
        keys={"context_parallel_size": 2, "cp_backend": "torch", "sample_packing": False},
        setup=_sliding_window_model,
    ),
    Case(
        "model-packed-without-attention-interface",
        keys={"sample_packing": True},
        setup=_bloom_model,
    ),
    Case(
        "model-packed-masks-unchecked",
        keys={"sample_packing": True},
        setup=_afmoe_model,
    ),
    Case(
        "model-stateful-layers-packed",
        keys={"sample_packing": True},
        setup=_short_convolution_model,
    ),
    Case(
        "model-stateful-layers-cp",
        keys={"context_parallel_size": 2, "sample_packing": False},
        setup=_short_convolution_model,
    ),
    Case(
        "model-temperature-packed",
        keys={"sample_packing": True},
        setup=_llama4_temperature_model,
    ),
    Case(
        "model-attention-softcapping",
        keys={"context_parallel_size": 2},
        setup=_softcapping_model,
    ),
    Case(
        "model-attention-sinks",
        keys={"context_parallel_size": 2, "cp_backend": "torch", "sample_packing": False},
        setup=_sinks_model,
    ),
    Case(
        "model-attention-dropout",
        keys={"context_parallel_size": 2},
        setup=_dropout_model,
    ),
    Case(
        "model-hidden-dropout",
        keys={"context_parallel_size": 2},
        setup=_hidden_dropout_model,
    ),
    Case(
        "lora-target-missing",
        keys={"lora_target_modules": ["q_projj"]},
    ),
    Case(
        "tokenizer-without-pad-or-eos",
        setup=_tokenizer_without_pad_or_eos,
    ),
    Case(
        "model-type-mismatch",
        keys={"model_type": "MistralForCausalLM"},
    ),
    Case(
        "lora-model-dir-missing",
        setup=_lora_model_dir_missing,
    ),
    Case(
        "modules-to-save-unknown",
        keys={"lora_modules_to_save": ["embed"]},
    ),
    Case(
        "unfrozen-selects-nothing",
        keys={"adapter": DELETE, "unfrozen_parameters": ["model.layers.+.mlp", "model.language_model.*"]},
    ),
    Case(
        "new-tokens-untrained",
        keys={"tokens": ["<tool>"]},
    ),
    Case(
        "new-tokens-frozen",
        keys={"adapter": DELETE, "tokens": ["<tool>"], "unfrozen_parameters": ["model.layers.+.mlp"]},
    ),
    Case(
        "cut-cross-entropy-softcapped-logits",
        keys={"cut_cross_entropy": True},
        setup=lambda ws: _saved_model(
            ws, "llama-softcap", _llama_like(ws, "LlamaConfig", final_logit_softcapping=30.0)
        ),
    ),
    Case(
        "activation-offloading-host-ram",
        keys={"activation_offloading": True, "gradient_checkpointing": True, "sequence_len": 1 << 40},
        command="validate",
    ),
    Case(
        "tp-not-dividing",
        keys={"fsdp_version": 2, "context_parallel_size": 2, "tensor_parallel_size": 2, "adapter": DELETE},
        args=("--nproc-per-node", "6"),
    ),
    Case(
        "tp-nothing-to-shard",
        keys={"fsdp_version": 2, "tensor_parallel_size": 2, "adapter": DELETE},
    ),
    Case(
        "tp-heads-not-dividing",
        keys={"fsdp_version": 2, "context_parallel_size": 2, "tensor_parallel_size": 3, "adapter": DELETE},
        args=("--nproc-per-node", "6"),
    ),
    Case(
        "tp-model-without-plan",
        keys={"fsdp_version": 2, "context_parallel_size": 2, "tensor_parallel_size": 2, "adapter": DELETE},
        setup=_bloom_model,
    ),
)
