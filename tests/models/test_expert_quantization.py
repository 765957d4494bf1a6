"""quantize_moe_experts: a mixture of experts' 3D expert tensors stored in 4 bits under QLoRA, on a tiny Qwen3-MoE."""

from __future__ import annotations

import gc
import importlib.util
import weakref
from pathlib import Path

import pytest
import torch

from cptune.config.loader import validate_recipe
from cptune.models.loading import apply_lora, load_model
from devtools.tiny import build_tiny_gpt_oss, build_tiny_mixtral, build_tiny_qwen3_moe

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="the quantization extra is not installed"
)

VOCAB = 97
LAYERS = 2  # the tiny Qwen3-MoE's decoder layers, every one sparse
QLORA = {
    "adapter": "qlora",
    "load_in_4bit": True,
    "gradient_checkpointing": True,
    "lora_target_modules": ["q_proj", "v_proj"],
}


BUILDERS = {"qwen3_moe": build_tiny_qwen3_moe, "mixtral": build_tiny_mixtral, "gpt_oss": build_tiny_gpt_oss}


def save_tiny(folder: Path, family: str) -> Path:
    BUILDERS[family](VOCAB, seed=1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe")


def recipe(model_dir: Path, **keys):
    return validate_recipe({"base_model": str(model_dir), "datasets": [{"path": "d.jsonl"}], **QLORA, **keys})


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts")]


def adapted(model: torch.nn.Module, recipe) -> torch.nn.Module:
    torch.manual_seed(7)  # the adapter's initialisation, the same for both models
    model = apply_lora(model, recipe)
    model.train()
    return model


def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.arange(3, 3 + 24).remainder(VOCAB).unsqueeze(0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_experts_are_stored_in_4_bits_and_train_exactly_as_their_dequantized_values(family, tmp_path):
    """The exactness claim: the quantized model computes, bit for bit, what the model whose expert tensors hold
    the dequantized values computes (same dtype, same adapter initialisation), and the LoRA adapters on the
    attention of the first layer get gradients through both layers' dequantized experts. Qwen3-MoE and
    Mixtral store ``experts x out x in``, gpt-oss ``experts x in x out`` with biases (left unquantized)."""
    moe_dir = save_tiny(tmp_path, family)
    quantized = load_model(recipe(moe_dir, quantize_moe_experts=True), "eager")
    plain = load_model(recipe(moe_dir), "eager")
    for packed, full in zip(experts_modules(quantized), experts_modules(plain), strict=True):
        stored = sum(p.numel() * p.element_size() for p in packed.parameters() if p.dtype == torch.uint8)
        weights = full.gate_up_proj.numel() + full.down_proj.numel()
        assert stored == weights // 2  # 4 bits a weight (plain: 4 bytes a weight, float32)
        assert all(not p.requires_grad for p in packed.parameters() if p.dtype == torch.uint8)
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                value = getattr(packed, name)
                assert (value.shape, value.dtype) == (getattr(full, name).shape, torch.float32)
                getattr(full, name).copy_(value)
    loss, grads = loss_and_grads(adapted(quantized, recipe(moe_dir, quantize_moe_experts=True)))
    expected_loss, expected_grads = loss_and_grads(adapted(plain, recipe(moe_dir)))
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys()
    assert all(torch.equal(grads[name], expected_grads[name]) for name in grads)
    first = [g for n, g in grads.items() if ".layers.0.self_attn." in n and "lora_B" in n]
    assert len(first) == 2 and all(g.abs().sum() > 0 for g in first)


def live_dequantized(model: torch.nn.Module) -> tuple[list[weakref.ref], list[int]]:
    """Weak references to every expert tensor the parametrizations dequantize, and during the backward the
    number alive each time one is dequantized."""
    from cptune.models.expert_quantization import Dequantize4bit

    made: list[weakref.ref] = []
    alive_then: list[int] = []

    def record(module, args, output):
        made.append(weakref.ref(output))
        if len(made) > 2 * LAYERS:  # past the forward's: the backward's recomputation
            gc.collect()
            alive_then.append(sum(ref() is not None for ref in made))

    for module in model.modules():
        if isinstance(module, Dequantize4bit):
            module.register_forward_hook(record)
    return made, alive_then


def test_the_backward_keeps_one_layers_dequantized_experts_at_a_time(moe_dir):
    """Gradient checkpointing drops the dequantized experts the forward multiplied with, and the backward
    dequantizes one layer's again as it recomputes it. Without checkpointing every layer's would stay alive
    between the forward and the backward (the second half shows the count sees them)."""
    keys = recipe(moe_dir, quantize_moe_experts=True)
    model = adapted(load_model(keys, "eager"), keys)
    made, alive_then = live_dequantized(model)
    ids = torch.arange(3, 3 + 24).remainder(VOCAB).unsqueeze(0)
    loss = model(input_ids=ids, labels=ids).loss
    gc.collect()
    assert len(made) == 2 * LAYERS and sum(ref() is not None for ref in made) == 0
    loss.backward()
    assert len(made) == 4 * LAYERS  # each layer's two tensors dequantized again in the backward
    # At each dequantization in the backward: that layer's gate_up_proj, then with it its down_proj; none of
    # the other layer's.
    assert alive_then == [1, 2] * LAYERS

    model.base_model.model.activation_checkpointing_disable()
    made, _ = live_dequantized(model)
    loss = model(input_ids=ids, labels=ids).loss
    gc.collect()
    assert sum(ref() is not None for ref in made) == 2 * LAYERS


def test_merging_dequantizes_the_experts_into_plain_parameters(moe_dir):
    from cptune.models.quantization import dequantize_in_place

    model = load_model(recipe(moe_dir, quantize_moe_experts=True), "eager")
    experts = experts_modules(model)[0]
    with torch.no_grad():
        expected = experts.down_proj.clone()
    dequantize_in_place(model)
    assert isinstance(experts._parameters["down_proj"], torch.nn.Parameter)
    assert torch.equal(experts.down_proj, expected)
    assert not any(p.dtype == torch.uint8 for p in model.parameters())


def test_the_packed_experts_take_no_adapter_and_the_estimate_counts_what_trains(moe_dir):
    """peft 0.21 adapts transformers 5's fused expert tensors when the targets are all-linear (cptune's default);
    packed, they are parametrized and take no adapter. The estimate from the config counts the same trained
    parameters as the loaded model has, with and without the key."""
    from cptune.models.loading import model_config, trainable_parameter_count
    from cptune.models.sizing import count_parameters

    def trained(**keys):
        keys = recipe(moe_dir, lora_target_modules=None, **keys)
        model = apply_lora(load_model(keys, "eager"), keys)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert count_parameters(keys, model_config(keys)).trainable == trainable_parameter_count(model)[0]
        return names

    plain, packed = trained(), trained(quantize_moe_experts=True)
    assert any(".experts." in n for n in plain)
    assert packed == [n for n in plain if ".experts." not in n]


def test_a_target_only_the_packed_experts_match_is_refused_before_loading(moe_dir):
    """down_proj names the experts' fused tensor of a Qwen3-MoE (peft carries the transformers 4 name over):
    adapted without the key, matched by nothing once they are packed."""
    from cptune.errors import CptuneError
    from cptune.models.loading import check_lora_targets, model_config

    targets = {"lora_target_modules": ["q_proj", "down_proj"]}
    check_lora_targets(recipe(moe_dir, **targets), model_config(recipe(moe_dir)))
    packed = recipe(moe_dir, **targets, quantize_moe_experts=True)
    with pytest.raises(CptuneError) as info:
        check_lora_targets(packed, model_config(packed))
    assert str(info.value) == (
        "lora_target_modules: 'down_proj' adapts nothing in Qwen3MoeForCausalLM (the other targets do, so peft "
        "would train without it). With quantize_moe_experts the experts' weights are packed in 4 bits and take no "
        "LoRA adapter (as in Axolotl, where only lora_target_parameters adapts them): remove the names that only "
        "the experts match, or remove quantize_moe_experts to adapt the experts in the training dtype."
    )
