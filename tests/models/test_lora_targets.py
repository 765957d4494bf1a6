"""LoRA targets on a mixture of experts (peft 0.21, transformers 5): each named target adapts something, or is refused."""

from __future__ import annotations

import pytest

from cptune.config.loader import validate_recipe
from cptune.errors import CptuneError
from cptune.models.loading import apply_lora, check_lora_targets, meta_model
from devtools.tiny import build_tiny_mixtral, build_tiny_qwen3_moe

BUILDERS = {"qwen3_moe": build_tiny_qwen3_moe, "mixtral": build_tiny_mixtral}


def recipe(targets: list[str] | None = None):
    keys = {"base_model": "unused", "datasets": [{"path": "d.jsonl"}], "adapter": "lora"}
    if targets is None:
        keys["lora_target_linear"] = True
    else:
        keys["lora_target_modules"] = targets
    return validate_recipe(keys)


def config(family: str):
    return BUILDERS[family](97, seed=1).config


def adapted(family: str, targets: list[str] | None) -> set[str]:
    """The names (within layer 0) of what the adapter trains."""
    r = recipe(targets)
    model = apply_lora(meta_model(r, config(family)), r, load_weights=False)
    names = (
        n.split("layers.0.", 1)[1]
        for n, p in model.named_parameters()
        if p.requires_grad and "layers.0." in n
    )
    return {n.split(".lora_")[0] for n in names}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_lora_target_linear_adapts_the_experts_fused_weights_and_the_router(family):
    # peft wraps the fused expert parameters (ParamWrapper): gate_up_proj nested inside down_proj's wrapper.
    assert {"mlp.experts", "mlp.experts.base_layer", "mlp.gate", "self_attn.q_proj"} <= adapted(family, None)


@pytest.mark.parametrize(
    ("family", "down"), [("qwen3_moe", "down_proj"), ("mixtral", "w2")], ids=["qwen3_moe", "mixtral"]
)
def test_a_named_expert_target_by_its_transformers_4_name_adapts_the_experts(family, down):
    check_lora_targets(recipe(["q_proj", down]), config(family))  # accepted
    assert adapted(family, ["q_proj", down]) == {"self_attn.q_proj", "mlp.experts"}


def test_a_target_that_adapts_nothing_beside_one_that_does_is_refused():
    """Mixtral's experts have no down_proj module (its transformers 4 name is w2): peft alone would train
    q_proj and silently leave the experts alone."""
    with pytest.raises(CptuneError) as refused:
        check_lora_targets(recipe(["q_proj", "down_proj"]), config("mixtral"))
    message = str(refused.value)
    assert message.startswith("lora_target_modules: 'down_proj' adapts nothing in MixtralForCausalLM"), (
        message
    )
    assert "Mixtral: w1, w3, w2" in message, message


@pytest.mark.parametrize("target", ["experts", "gate_up_proj"])
def test_the_experts_module_or_its_fused_parameter_name_is_refused_in_one_line(target):
    with pytest.raises(CptuneError) as refused:
        check_lora_targets(recipe([target]), config("qwen3_moe"))
    message = str(refused.value)
    assert message.startswith("lora_target_modules: "), message
    assert "\n" not in message
    if target == "experts":  # was "lora_target_modules: Target module Qwen3MoeExperts(": peft's repr cut off
        assert "peft cannot adapt a Qwen3MoeExperts module" in message, message
