"""Which frozen weights peft saves with an adapter, asked of peft (cptune.run.training.adapter_save).

The ZeRO-3 save itself, against the save without DeepSpeed: tests/run/test_deepspeed_runs.py.
"""

from __future__ import annotations

import warnings

import pytest
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from cptune.run.training.adapter_save import frozen_parameters_peft_saves

EMBEDDINGS = ["base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"]


def peft_model(model_dir, *, new_tokens: int, modules_to_save=None):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if new_tokens:
        model.resize_token_embeddings(model.get_input_embeddings().num_embeddings + new_tokens)
    config = LoraConfig(r=4, target_modules="all-linear", modules_to_save=modules_to_save)
    return get_peft_model(model, config)


def saved_frozen(model) -> list[str]:
    """What peft's save picks from the real state dict, of the frozen parameters."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    state = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        picked = {id(t) for t in get_peft_model_state_dict(model, state_dict=state).values()}
    return sorted(name for name in frozen if id(state[name]) in picked)


@pytest.mark.parametrize(
    ("new_tokens", "modules_to_save", "expected"),
    [
        (0, None, []),  # the base vocabulary: the adapter alone
        (1, None, EMBEDDINGS),  # a new pad token grew both embeddings: peft saves them whole
        (
            2,
            ["embed_tokens", "lm_head"],
            [name.replace(".weight", ".original_module.weight") for name in EMBEDDINGS],
        ),
    ],
    ids=["same-vocabulary", "grown", "grown-and-trained"],
)
def test_the_frozen_weights_peft_saves_are_found_without_reading_them(
    tiny_model_dir, new_tokens, modules_to_save, expected
):
    model = peft_model(tiny_model_dir, new_tokens=new_tokens, modules_to_save=modules_to_save)
    found = frozen_parameters_peft_saves(model)
    assert sorted(found) == sorted(expected) == saved_frozen(model)
