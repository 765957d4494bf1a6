"""Sizing a mixture of experts from its config: every expert's weights in the states, the routed width in activations."""

from __future__ import annotations

import pytest

from cptune.config.loader import validate_recipe
from cptune.models.sizing import count_parameters, model_shape
from devtools.tiny import build_tiny_mixtral, build_tiny_qwen3_moe

BUILDERS = {"qwen3_moe": build_tiny_qwen3_moe, "mixtral": build_tiny_mixtral}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_state_count_holds_every_experts_weights(family):
    model = BUILDERS[family](97, seed=1)
    recipe = validate_recipe({"base_model": "unused", "datasets": [{"path": "d.jsonl"}]})
    counts = count_parameters(recipe, model.config)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert experts == 2 * 4 * (64 * 2 * 32 + 32 * 64)  # 2 layers x 4 experts x (gate_up + down)
    assert counts.total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_activation_width_is_the_routed_one(family):
    # 2 experts per token, each 32 wide: Qwen3-MoE's dense intermediate_size (256) is used by no layer, and
    # Mixtral's intermediate_size (32) is one expert's.
    assert model_shape(BUILDERS[family](97, seed=1).config).intermediate == 2 * 32


def test_dense_layers_beside_sparse_ones_take_the_wider_and_a_shared_expert_adds_its_width():
    with_dense = build_tiny_qwen3_moe(97, seed=1, mlp_only_layers=[0]).config
    assert model_shape(with_dense).intermediate == 256
    from transformers import Qwen2MoeConfig

    shared = Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=40,
    )  # fmt: skip
    assert model_shape(shared).intermediate == 2 * 8 + 40
