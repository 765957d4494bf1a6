"""unfrozen_parameters on the tiny Llama: exactly the selected parameters train, the others get no gradient."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import LlamaForCausalLM

from cptune.config.loader import validate_recipe
from cptune.errors import CptuneError
from cptune.models.freezing import freeze_all_but
from cptune.models.sizing import count_parameters
from devtools.tiny import tiny_llama_config

VOCAB = 97


def tiny_model(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(VOCAB, **overrides))


def trained_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def test_only_the_selected_parameters_require_and_receive_gradients():
    model = tiny_model()
    trained = freeze_all_but(model, ["model.layers.1.mlp", "^lm_head.weight$"])
    expected = [
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "lm_head.weight",
    ]
    assert trained_names(model) == expected
    assert trained == 3 * 64 * 256 + VOCAB * 64
    ids = torch.arange(1, 17).reshape(2, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        if name in expected:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_patterns_read_names_as_axolotl_does():
    # Matched at the start of the name, not anywhere in it: "mlp" selects nothing of "model.layers.0.mlp...".
    with pytest.raises(CptuneError, match="'mlp' selects no parameter"):
        freeze_all_but(tiny_model(), ["mlp"])
    # A dot is a literal dot ("model.layers.1.self_attn" does not select layer 10's), ".+" stands for any
    # text, and "$" ends the name.
    model = tiny_model(num_hidden_layers=11)
    freeze_all_but(
        model, ["model.layers.1.self_attn.q_proj", "model.layers.+.post_attention_layernorm.weight$"]
    )
    assert sorted(trained_names(model)) == sorted(
        [
            "model.layers.1.self_attn.q_proj.weight",
            *(f"model.layers.{i}.post_attention_layernorm.weight" for i in range(11)),
        ]
    )
    # No end anchor: "model.layers.1" selects layer 10 as well.
    model = tiny_model(num_hidden_layers=11)
    freeze_all_but(model, ["model.layers.1"])
    assert {name.split(".")[2] for name in trained_names(model)} == {"1", "10"}
    # Were the dot a wildcard, "gate.proj" would select "gate_proj".
    with pytest.raises(CptuneError, match=re.escape("'model.layers.0.mlp.gate.proj' selects no parameter")):
        freeze_all_but(tiny_model(), ["model.layers.0.mlp.gate.proj"])
    # Axolotl's trailing ".*" (any number of dots) selects what the text before it selects.
    model = tiny_model()
    freeze_all_but(model, ["model.norm.*"])
    assert trained_names(model) == ["model.norm.weight"]


def test_a_tied_output_head_is_selected_by_either_of_its_names():
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    freeze_all_but(model, ["^lm_head.weight$"])
    assert trained_names(model) == ["model.embed_tokens.weight"]  # one tensor, listed under its first name


def test_a_pattern_that_selects_nothing_is_refused_naming_it_and_the_models_names():
    model = tiny_model()
    with pytest.raises(CptuneError) as refused:
        freeze_all_but(model, ["model.layers.+.mlp", "model.language_model.*"])
    assert str(refused.value) == (
        "unfrozen_parameters: 'model.language_model.*' selects no parameter of the model, whose parameters are "
        "named model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, "
        "model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight, "
        "model.layers.0.self_attn.o_proj.weight, model.layers.0.mlp.gate_proj.weight (and 15 more). A pattern must "
        "match the start of a name (a dot is a literal dot, .+ stands for any text): fix or remove it, so that the "
        "run does not train less than you meant."
    )
    assert all(p.requires_grad for p in model.parameters())  # refused before anything was frozen


def test_the_memory_estimate_counts_only_the_selected_parameters_as_trained():
    model = tiny_model()
    keys = {"base_model": "unused", "datasets": [{"path": "d.jsonl"}]}
    full = count_parameters(validate_recipe(keys), model.config)
    part = count_parameters(validate_recipe({**keys, "unfrozen_parameters": ["^lm_head"]}), model.config)
    assert part.total == full.total == sum(p.numel() for p in model.parameters())
    assert full.trainable == full.total
    assert part.trainable == VOCAB * 64 and part.trainable_shapes == ((VOCAB, 64),)
