"""Catalogue cases of the section "Recipe keys and values" (their text: devtools/docgen/errors/recipe_keys.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import DELETE, Case
from tests.reliability.catalogue.setups import _chat_mapping_extra_key, _dataset

CASES: tuple[Case, ...] = (
    Case(
        "key-misspelt",
        keys={"sequnce_len": 64},
    ),
    Case(
        "key-unknown",
        keys={"turbo_mode": True},
    ),
    Case(
        "key-axolotl-unsupported",
        keys={"torch_compile": True},
    ),
    Case(
        "key-axolotl-no-counterpart",
        keys={"sage_attention": True},
    ),
    Case(
        "key-axolotl-plugin",
        keys={"use_scattermoe": True},
    ),
    Case(
        "key-axolotl-other-name-clash",
        keys={"revision_of_model": "v1", "model_revision": "v2"},
    ),
    Case(
        "quantization-config-not-mxfp4",
        keys={"model_quantization_config": "FineGrainedFP8Config"},
    ),
    Case(
        "dataset-key-misspelt",
        setup=lambda ws: _dataset(ws, str(ws.data / "train.jsonl"), feild_output="answer"),
    ),
    Case(
        "key-required-missing",
        keys={"base_model": DELETE},
    ),
    Case(
        "type-not-an-integer",
        keys={"micro_batch_size": "two"},
    ),
    Case(
        "type-not-a-boolean",
        keys={"sample_packing": "maybe"},
    ),
    Case(
        "range-lora-r",
        keys={"lora_r": 0},
    ),
    Case(
        "range-lora-dropout",
        keys={"lora_dropout": 1.5},
    ),
    Case(
        "range-learning-rate",
        keys={"learning_rate": -2e-4},
    ),
    Case(
        "choice-misspelt",
        keys={"cp_backend": "ring-flash"},
    ),
    Case(
        "datasets-empty",
        keys={"datasets": []},
    ),
    Case(
        "datasets-not-a-list",
        setup=lambda ws: {"datasets": {"path": str(ws.data / "train.jsonl"), "type": "alpaca"}},
    ),
    Case(
        "override-unknown-key",
        args=("--sequnce_len=64",),
    ),
    Case(
        "option-with-underscores",
        args=("--nproc_per_node=2",),
    ),
    Case(
        "override-malformed",
        args=("--lora_r",),
    ),
    Case(
        "override-index-out-of-range",
        args=("--datasets.3.path=x.jsonl",),
    ),
    Case(
        "override-inside-a-value",
        args=("--sequence_len.x=1",),
    ),
    Case(
        "fsdp-key-twice",
        keys={"fsdp_version": 2, "fsdp_config": {"fsdp_offload_params": True, "offload_params": False}},
    ),
    Case(
        "attn-implementation-unsupported",
        keys={"attn_implementation": "eager"},
    ),
    Case(
        "reentrant-checkpointing",
        keys={"gradient_checkpointing_kwargs": {"use_reentrant": False, "preserve_rng_state": False}},
    ),
    Case(
        "model-type-not-causal",
        keys={"model_type": "AutoModel"},
    ),
    Case(
        "lora-kernel-with-dropout",
        keys={"adapter": "lora", "lora_dropout": 0.05, "lora_qkv_kernel": True},
    ),
    Case(
        "chat-template-not-built-in",
        keys={"chat_template": "deepseek_v3"},
    ),
    Case(
        "message-mappings-extra-key",
        setup=_chat_mapping_extra_key,
    ),
    Case(
        "activation-offloading-disk",
        keys={"activation_offloading": "disk", "gradient_checkpointing": True},
    ),
    Case(
        "activation-offloading-two-level-sharded",
        keys={"activation_offloading": "two_level", "gradient_checkpointing": True, "fsdp_version": 2},
    ),
    Case(
        "tiled-mlp-generic-mlp",
        keys={"tiled_mlp": True, "tiled_mlp_use_original_mlp": False},
    ),
    Case(
        "plugins-unknown",
        keys={"plugins": ["axolotl.integrations.spectrum.SpectrumPlugin"]},
    ),
    Case(
        "unfrozen-row-range",
        keys={
            "adapter": DELETE,
            "unfrozen_parameters": ["^lm_head.weight$", "^model.embed_tokens.weight$[:32000]"],
        },
    ),
    Case(
        "unfrozen-not-a-pattern",
        keys={"adapter": DELETE, "unfrozen_parameters": ["model.(layers"]},
    ),
)
