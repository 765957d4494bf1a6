"""The recipe's key groups compose without hiding one another.

The Recipe inherits every group (:data:`cptune.config.recipe.KEY_GROUPS_IN_ORDER`): a validator, property
or field two groups both define would be one group's only, and the other group's keys would silently
lose it (the one-string form of ``report_to``, ``lora_target_modules`` and ``plugins`` once did, all
three groups naming their validator ``_one_or_many``).
"""

from __future__ import annotations

import pytest

from cptune.config.loader import validate_recipe
from cptune.config.recipe import KEY_GROUPS_IN_ORDER

MINIMAL = {"base_model": "m", "datasets": [{"path": "d.jsonl"}]}


def test_no_two_key_groups_define_the_same_member():
    owners: dict[str, str] = {}
    clashes = []
    for group in KEY_GROUPS_IN_ORDER:
        for name in vars(group):
            if name.startswith("__") or name in {"_abc_impl", "model_config", "model_fields"}:
                continue
            if name in owners:
                clashes.append(f"{name}: {owners[name]} and {group.__name__}")
            owners.setdefault(name, group.__name__)
    assert not clashes, clashes


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("report_to", "tensorboard"),
        ("lora_target_modules", "q_proj"),
        ("plugins", "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"),
        ("tokens", "<fact>"),
        ("lora_modules_to_save", "lm_head"),
        ("optim_target_modules", "attn"),
    ],
)
def test_a_list_key_takes_one_string(key, value):
    keys = {"adapter": "lora"} if key == "lora_modules_to_save" else {}
    recipe = validate_recipe({**MINIMAL, **keys, key: value})
    assert getattr(recipe, key) == (value,)
