"""Quantized bases (QLoRA, 8-bit), the tokens a recipe adds, and the Axolotl model keys checked at load."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from cptune.config.loader import validate_recipe
from cptune.errors import BackendUnavailableError, CptuneError
from cptune.models.added_tokens import check_new_token_training, fit_embeddings
from cptune.models.loading import (
    apply_lora,
    check_lora_model_dir,
    check_model_type,
    load_model,
    load_tokenizer_with_additions,
    meta_model,
)
from cptune.models.quantization import quantization_config
from tests.numerics import assert_within, reorder_bound

needs_bitsandbytes = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="the quantization extra is not installed"
)


def recipe(model_dir: Path, **keys):
    return validate_recipe({"base_model": str(model_dir), "datasets": [{"path": "d.jsonl"}], **keys})


QLORA = {"adapter": "qlora", "load_in_4bit": True}


@needs_bitsandbytes
def test_quantization_config_follows_axolotls_defaults_and_the_training_dtype(tiny_model_dir):
    config = quantization_config(recipe(tiny_model_dir, **QLORA, bf16=True), torch.bfloat16)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == config.bnb_4bit_quant_storage == torch.bfloat16
    custom = recipe(
        tiny_model_dir,
        **QLORA,
        bnb_config_kwargs={"bnb_4bit_quant_type": "fp4", "bnb_4bit_quant_storage": "uint8"},
    )
    config = quantization_config(custom, torch.float32)
    assert (config.bnb_4bit_quant_type, config.bnb_4bit_quant_storage) == ("fp4", torch.uint8)
    assert quantization_config(
        recipe(tiny_model_dir, adapter="lora", load_in_8bit=True), torch.float32
    ).load_in_8bit
    assert quantization_config(recipe(tiny_model_dir), torch.float32) is None


@needs_bitsandbytes
def test_4bit_layers_stay_exact_and_differentiable_after_an_evaluation(tiny_model_dir):
    """bitsandbytes 0.50.2 switched a CPU 4-bit layer to a bf16 inference kernel after its first no-grad
    eval forward (on CPUs with AVX512-BF16), and kept using it in training: bf16 results, and no gradient
    through the layer, so the layers below stopped learning after the first evaluation."""
    import bitsandbytes as bnb

    model = load_model(recipe(tiny_model_dir, **QLORA), "sdpa")
    layer = model.model.layers[0].mlp.down_proj
    weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).clone()
    x = torch.randn(1, 16, layer.in_features)
    model.eval()
    with torch.no_grad():
        layer(x)
    model.train()
    x.requires_grad_(True)
    y = layer(x)
    (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(y, x @ weight.t())
    # Bound: each element sums out_features products of a 1 and a weight, in any order.
    assert_within(grad, torch.ones_like(y) @ weight, reorder_bound(y.shape[-1], weight.abs().sum(0)))


def test_missing_bitsandbytes_is_refused_before_launching(tiny_model_dir, monkeypatch):
    from cptune.run.launch.preflight import missing_packages

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name)
    )
    (problem, *_) = missing_packages(recipe(tiny_model_dir, **QLORA))
    assert isinstance(problem, BackendUnavailableError)
    assert str(problem) == (
        "load_in_4bit: quantizing the base model needs bitsandbytes, which is not installed; "
        "pip install 'cptune[quantization]' (bitsandbytes>=0.50)."
    )


def test_new_tokens_grow_the_embeddings_and_need_training_with_lora(tiny_model_dir):
    lora = recipe(
        tiny_model_dir, adapter="lora", special_tokens={"pad_token": "<|end_of_text|>"}, tokens=["<tool>"]
    )
    tokenizer, added = load_tokenizer_with_additions(lora)
    assert added == ["<|end_of_text|>", "<tool>"] and tokenizer.pad_token == "<|end_of_text|>"
    config = __import__("transformers").AutoConfig.from_pretrained(tiny_model_dir)
    with pytest.raises(CptuneError) as error:
        check_new_token_training(lora, tokenizer, added, meta_model(lora, config))
    assert "adds 1 token(s) the tokenizer did not have (<tool>)" in str(error.value)
    assert "lora_modules_to_save: [embed_tokens, lm_head]" in str(error.value)
    # Trained through lora_modules_to_save: accepted; a new pad token alone needs nothing.
    trained = recipe(
        tiny_model_dir, adapter="lora", tokens=["<tool>"], lora_modules_to_save=["embed_tokens", "lm_head"]
    )
    check_new_token_training(trained, tokenizer, added, meta_model(trained, config))
    pad_only = recipe(tiny_model_dir, adapter="lora", special_tokens={"pad_token": "<|end_of_text|>"})
    check_new_token_training(pad_only, *load_tokenizer_with_additions(pad_only), meta_model(pad_only, config))

    model = load_model(trained, "sdpa")
    fit_embeddings(model, tokenizer, trained)
    rows = model.get_input_embeddings().weight.detach().clone()
    assert rows.shape[0] == len(tokenizer) == config.vocab_size + 2
    again = load_model(trained, "sdpa")
    fit_embeddings(again, tokenizer, trained)
    assert torch.equal(again.get_input_embeddings().weight, rows)  # every rank grows the same rows
    wrapped = apply_lora(model, trained)
    saved = {n for n, p in wrapped.named_parameters() if p.requires_grad and "modules_to_save" in n}
    assert any("embed_tokens" in n for n in saved) and any("lm_head" in n for n in saved)


def test_model_type_must_name_the_models_class(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    for ok in ("AutoModelForCausalLM", "LlamaForCausalLM"):
        check_model_type(recipe(tiny_model_dir, model_type=ok), config)
    with pytest.raises(CptuneError, match="model_type: MistralForCausalLM is not the class of"):
        check_model_type(recipe(tiny_model_dir, model_type="MistralForCausalLM"), config)


def test_lora_model_dir_starts_from_the_saved_adapter(tiny_model_dir, tmp_path):
    first = apply_lora(
        load_model(recipe(tiny_model_dir, adapter="lora"), "sdpa"), recipe(tiny_model_dir, adapter="lora")
    )
    with torch.no_grad():
        for name, param in first.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    first.save_pretrained(tmp_path / "adapter")
    resumed = recipe(tiny_model_dir, adapter="lora", lora_model_dir=str(tmp_path / "adapter"))
    check_lora_model_dir(resumed)
    model = apply_lora(load_model(resumed, "sdpa"), resumed)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.requires_grad and torch.all(p == 0.01) for p in lora_b)
    with pytest.raises(CptuneError, match=r"holds no adapter_config\.json"):
        check_lora_model_dir(recipe(tiny_model_dir, adapter="lora", lora_model_dir=str(tmp_path)))
