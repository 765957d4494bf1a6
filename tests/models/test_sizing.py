"""Sizing a mixture of experts from its config: every expert's weights in the states, the routed width in activations."""

from __future__ import annotations

import math

import pytest
import torch

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


def test_quantizing_a_mixture_of_experts_leaves_its_expert_tensors_in_the_training_dtype(tmp_path):
    """bitsandbytes quantizes linear layers only; a Qwen3-MoE keeps its experts in 3D tensors, which load_in_4bit
    leaves in bf16 (measured on CPU with bitsandbytes 0.50 and transformers 5.23). The count and the memory estimate
    say so, rather than counting every frozen weight as 4-bit."""
    from cptune.run.memory_plan import describe_state_memory
    from cptune.run.plan import RunPlan

    model = build_tiny_qwen3_moe(97, seed=1)
    recipe = validate_recipe(
        {
            "base_model": "unused",
            "datasets": [{"path": "d.jsonl"}],
            "adapter": "qlora",
            "load_in_4bit": True,
            "bf16": True,
        }
    )
    counts = count_parameters(recipe, model.config)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    linear = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()
    )
    assert (counts.quantized, counts.unquantized_experts) == (linear, experts)
    lines = describe_state_memory(RunPlan.build(recipe, 1), model.config)
    assert f"  {experts:,} weights of the experts stay in bfloat16 with load_in_4bit: " in "\n".join(lines)


def test_quantize_moe_experts_counts_the_expert_tensors_in_4_bits():
    """With quantize_moe_experts the experts' 3D tensors are quantized like the linear layers: the estimate counts
    them at bitsandbytes' 4-bit size and drops the line that says they stay in the training dtype."""
    from cptune.parallel.memory import format_bytes, quantized_bytes_per_weight
    from cptune.run.memory_plan import describe_state_memory, state_layout, states_per_rank
    from cptune.run.plan import RunPlan

    model = build_tiny_qwen3_moe(97, seed=1)
    keys = {
        "base_model": "unused",
        "datasets": [{"path": "d.jsonl"}],
        "adapter": "qlora",
        "load_in_4bit": True,
        "bf16": True,
        "gradient_checkpointing": True,
        "lora_target_modules": ["q_proj", "v_proj"],  # the same adapter with and without the key
    }
    plain = validate_recipe(keys)
    recipe = validate_recipe({**keys, "quantize_moe_experts": True})
    before, counts = count_parameters(plain, model.config), count_parameters(recipe, model.config)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert (counts.quantized, counts.unquantized_experts) == (before.quantized + experts, 0)
    assert (counts.total, counts.trainable) == (before.total, before.trainable)
    lines = describe_state_memory(RunPlan.build(recipe, 1), model.config)
    assert not any("weights of the experts stay in" in line for line in lines)
    assert (
        f"  quantize_moe_experts: the {experts:,} weights of the experts are packed in 4 bits once the model is "
        f"loaded; while it loads, the GPU holds them in bfloat16 ({format_bytes(experts * 2)}) beside the other "
        "weights."
    ) in lines
    assert f"{counts.quantized:,} base weights in 4 bits" in lines[0]
    # The weights column drops each expert weight's bf16 bytes for its 4-bit bytes, constants included.
    plan = RunPlan.build(recipe, 1)
    layout = state_layout(plan, plan.dims)
    saved = states_per_rank(plain, before, layout).weights - states_per_rank(recipe, counts, layout).weights
    per_weight = quantized_bytes_per_weight(4)
    assert saved == (
        (counts.quantized - before.quantized) * 2
        - (math.ceil(counts.quantized * per_weight) - math.ceil(before.quantized * per_weight))
    )
