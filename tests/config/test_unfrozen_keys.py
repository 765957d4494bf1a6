"""unfrozen_parameters in the recipe: Axolotl's pattern lists accepted; row ranges, bad patterns, adapters refused."""

from __future__ import annotations

import pytest

from cptune.config.loader import validate_recipe
from cptune.config.unfrozen import matches, name_regex, row_range
from cptune.errors import RecipeError

MINIMAL = {"base_model": "m", "datasets": [{"path": "d.jsonl"}]}


def problems(data):
    with pytest.raises(RecipeError) as info:
        validate_recipe(data)
    return {p.key: p.message for p in info.value.problems}


def test_axolotls_pattern_lists_are_accepted():
    # The lists of Axolotl's mixtral_22 and qwen3.5/27b-fft examples.
    mixtral = [
        "^lm_head.weight$",
        "^model.embed_tokens.weight$",
        "model.layers.4[4-9]+.block_sparse_moe.gate",
        "model.layers.5[0-5]+.block_sparse_moe.experts",
    ]
    assert validate_recipe({**MINIMAL, "unfrozen_parameters": mixtral}).unfrozen_parameters == tuple(mixtral)
    recipe = validate_recipe({**MINIMAL, "unfrozen_parameters": ["model.language_model.*", "lm_head.*"]})
    assert recipe.unfrozen_parameters == ("model.language_model.*", "lm_head.*")
    assert validate_recipe({**MINIMAL, "unfrozen_parameters": "lm_head"}).unfrozen_parameters == ("lm_head",)
    assert validate_recipe({**MINIMAL, "unfrozen_parameters": None}).unfrozen_parameters is None


def test_names_are_matched_from_their_start_with_literal_dots():
    def selects(pattern: str, name: str) -> bool:
        return matches(name_regex(pattern), name)

    assert selects(
        "model.layers.4[4-9]+.block_sparse_moe.gate", "model.layers.45.block_sparse_moe.gate.weight"
    )
    assert not selects(
        "model.layers.4[4-9]+.block_sparse_moe.gate", "model.layers.43.block_sparse_moe.gate.weight"
    )
    assert not selects("layers.45", "model.layers.45.mlp.up_proj.weight")  # from the start only
    assert not selects("model.norm", "modelxnorm.weight")  # a literal dot
    assert selects("model.norm", "model.normalizer.weight")  # no end anchor without $
    assert not selects("^model.norm.weight$", "model.norm.weight.extra")
    assert selects("model.+.mlp", "model.layers.3.mlp.down_proj.weight")  # .+ is any text
    assert selects(r"model\.norm", "model.norm.weight")  # an escaped dot is a dot too
    assert selects("model.language_model.*", "model.language_model.layers.0.mlp.up_proj.weight")
    assert not selects("model.language_model.*", "model.vision_tower.encoder.weight")


def test_axolotls_row_ranges_are_refused_naming_the_pattern():
    assert row_range("^model.embed_tokens.weight$[:32000]") == "[:32000]"
    assert row_range("features.layer[5]") == "[5]"
    assert row_range("model.layers.4[4-9]+.mlp") is None and row_range("model.layers.[0-7].") is None
    assert problems(
        {**MINIMAL, "unfrozen_parameters": ["lm_head", "^model.embed_tokens.weight$[:32000]"]}
    ) == {
        "unfrozen_parameters": "'^model.embed_tokens.weight$[:32000]' ends in Axolotl's row range [:32000], which "
        "cptune does not support: it trains whole parameters (Axolotl zeroes the other rows' gradients, which still "
        "lets weight decay move them and keeps optimizer state for every row); remove the range to train the whole "
        "parameter."
    }


def test_a_pattern_that_is_no_regular_expression_is_refused():
    assert problems({**MINIMAL, "unfrozen_parameters": ["model.(layers"]}) == {
        "unfrozen_parameters": "'model.(layers' is not a regular expression (missing ), unterminated subpattern); "
        "each entry is a pattern matched at the start of a parameter's name, e.g. model.layers.+.mlp or "
        "^lm_head.weight$."
    }


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_an_adapter_is_refused_naming_both_keys_and_what_to_use(adapter):
    keys = {**MINIMAL, "adapter": adapter, "unfrozen_parameters": ["^model.language_model.*", "^lm_head.*"]}
    if adapter == "qlora":
        keys["load_in_4bit"] = True
    assert problems(keys) == {
        "unfrozen_parameters": f"selects the parameters of a full fine-tune, but adapter: {adapter} trains a LoRA "
        "adapter (Axolotl matches these patterns against the adapter-wrapped names, base_model.model.…, and freezes "
        "what they miss, the adapter included). To train whole modules next to the adapter, name them in "
        "lora_modules_to_save (e.g. [lm_head]); to adapt fewer layers, set lora_target_modules; or remove adapter "
        "to train only the selected parameters."
    }
    # An empty list selects nothing to freeze (Axolotl ignores it too): no conflict.
    assert validate_recipe({**keys, "unfrozen_parameters": []}).unfrozen_parameters == ()
