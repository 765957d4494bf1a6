"""The recipe's preference keys (rl, rl_beta/dpo_beta, dpo_label_smoothing, orpo_alpha, simpo_gamma, cpo_alpha)
and what they refuse.

The catalogue (tests/reliability/catalogue/preference.py) runs every refusal through the CLI; this
checks what the keys resolve to and that the layouts that are built validate.
"""

from __future__ import annotations

import pytest

from cptune.config.loader import validate_recipe
from cptune.errors import RecipeError

PAIRS = {"path": "pairs.jsonl", "type": "chat_template.default"}


def recipe(**keys):
    return validate_recipe({"base_model": "m", "adapter": "lora", "datasets": [PAIRS], "rl": "dpo", **keys})


@pytest.mark.parametrize(
    ("keys", "beta"),
    [({}, 0.1), ({"rl_beta": 0.3}, 0.3), ({"dpo_beta": 0.2}, 0.2), ({"rl_beta": 0.2, "dpo_beta": 0.2}, 0.2)],
)
def test_beta_is_rl_beta_or_dpo_beta_or_trls_default(keys, beta):
    assert recipe(**keys).resolved_beta == beta


@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"rl": "ipo"},
        {"adapter": "qlora", "load_in_4bit": True},
        {"dpo_label_smoothing": 0.1},
        {"context_parallel_size": 4},
        {"context_parallel_size": 2, "sample_packing": True, "cut_cross_entropy": True},
        {"context_parallel_size": 2, "cp_backend": "torch", "sample_packing": False},
        {"adapter": None, "precompute_ref_log_probs": True},
        {"precompute_ref_log_probs": True},
        {"context_parallel_size": 2, "cp_backend": "deepspeed"},
        {"context_parallel_size": 2, "cp_backend": "deepspeed", "sample_packing": True},
        {"context_parallel_size": 2, "cp_backend": "deepspeed", "ulysses_attn_implementation": "sdpa"},
        {"datasets": [{"path": "p.jsonl", "type": "passthrough.default", "field_prompt": "question"}]},
        {"test_datasets": [PAIRS]},  # evaluation of held-out pairs
        {"val_set_size": 0.1},
        {"rl": "orpo", "orpo_alpha": 0.2},
        {"rl": "simpo", "simpo_gamma": 0.8, "cpo_alpha": 0.0, "rl_beta": 2.0},
        # No reference model: a full fine-tune, or one from a trained adapter, trains as it is.
        {"rl": "orpo", "adapter": None},
        {"rl": "simpo", "adapter": None, "context_parallel_size": 2, "cp_backend": "deepspeed"},
        {"rl": "simpo", "lora_model_dir": "adapter"},
        # The model states sharded: FSDP2 or ZeRO, LoRA or a full fine-tune (refused before issue 31's sharding).
        {"fsdp_version": 2, "dp_shard_size": 2, "context_parallel_size": 2},
        {"fsdp_version": 2, "adapter": None, "precompute_ref_log_probs": True, "context_parallel_size": 2},
        {"zero_stage": 3, "context_parallel_size": 2},
        {"zero_stage": 2, "adapter": None, "precompute_ref_log_probs": True, "context_parallel_size": 2},
        {"context_parallel_size": 2, "cp_backend": "deepspeed", "zero_stage": 3},
        # Tensor parallelism with a loss that reads no reference (refused before issue 31's tp2 x cp2 parity cases),
        # and with DPO/IPO's precomputed reference (refused while the first pass counted each row tp times).
        {
            "tensor_parallel_size": 2,
            "fsdp_version": 2,
            "context_parallel_size": 2,
            "adapter": None,
            "precompute_ref_log_probs": True,
        },
        {
            "rl": "ipo",
            "tensor_parallel_size": 2,
            "fsdp_version": 2,
            "adapter": None,
            "precompute_ref_log_probs": True,
        },
        {
            "rl": "simpo",
            "tensor_parallel_size": 2,
            "fsdp_version": 2,
            "context_parallel_size": 2,
            "adapter": None,
        },
    ],
)
def test_the_built_layouts_validate(keys):
    assert recipe(**keys).is_preference


@pytest.mark.parametrize(
    ("keys", "key"),
    [
        ({"rl": "kto"}, "rl"),
        ({"rl": "grpo"}, "rl"),
        ({"adapter": None}, "adapter"),
        (
            {"context_parallel_size": 2, "cp_backend": "torch", "causal": False, "cp_load_balance": False},
            "causal",
        ),
        # Tensor parallelism splits full fine-tunes only, as without rl.
        ({"tensor_parallel_size": 2, "fsdp_version": 2, "context_parallel_size": 2}, "adapter"),
    ],
)
def test_what_is_not_built_is_refused_naming_the_key(keys, key):
    with pytest.raises(RecipeError) as refused:
        recipe(**keys)
    assert f"  - {key}:" in str(refused.value)


@pytest.mark.parametrize(("packing", "rows"), [(False, 6), (True, 3)])
def test_unpacked_pairs_take_a_row_per_side(packing, rows):
    trained = recipe(sample_packing=packing, micro_batch_size=3)
    assert trained.pair_sides_in_own_rows is not packing and trained.rows_per_micro_batch == rows


def test_a_full_fine_tune_is_told_to_precompute_the_reference():
    with pytest.raises(RecipeError, match="Set precompute_ref_log_probs: true"):
        recipe(adapter=None)


def test_a_supervised_recipe_is_not_preference():
    plain = validate_recipe({"base_model": "m", "datasets": [{"path": "d.jsonl"}]})
    assert not plain.is_preference and plain.rl_refusal() is None


@pytest.mark.parametrize(
    ("keys", "resolved"),
    [
        ({"rl": "orpo"}, (0.1, 0.5, 1.0)),
        ({"rl": "orpo", "orpo_alpha": 0.25}, (0.25, 0.5, 1.0)),
        ({"rl": "simpo"}, (0.1, 0.5, 1.0)),
        ({"rl": "simpo", "rl_beta": 2.5, "simpo_gamma": 1.2, "cpo_alpha": 0}, (2.5, 1.2, 0.0)),
    ],
)
def test_variant_keys_resolve_to_trls_defaults(keys, resolved):
    """β (ORPO's λ from orpo_alpha), γ and the NLL weight, each TRL's default when unset (ORPOConfig, CPOConfig)."""
    r = recipe(**keys)
    assert (r.resolved_beta, r.resolved_simpo_gamma, r.resolved_cpo_alpha) == resolved
    assert not r.needs_reference


@pytest.mark.parametrize(
    ("keys", "key", "says"),
    [
        ({"orpo_alpha": 0.2}, "orpo_alpha", "applies only with rl: orpo (not rl: dpo)"),
        ({"rl": "simpo", "orpo_alpha": 0.2}, "orpo_alpha", "applies only with rl: orpo (not rl: simpo)"),
        ({"rl": "orpo", "simpo_gamma": 0.5}, "simpo_gamma", "applies only with rl: simpo (not rl: orpo)"),
        ({"rl": "ipo", "cpo_alpha": 1.0}, "cpo_alpha", "applies only with rl: simpo (not rl: ipo)"),
        (
            {"rl": None, "datasets": [{"path": "d.jsonl"}], "cpo_alpha": 1.0},
            "cpo_alpha",
            "only with rl: simpo;",
        ),
        ({"rl": "orpo", "rl_beta": 0.2}, "rl_beta", "set orpo_alpha instead"),
        ({"rl": "orpo", "dpo_beta": 0.2}, "dpo_beta", "set orpo_alpha instead"),
        ({"rl": "simpo", "precompute_ref_log_probs": True}, "precompute_ref_log_probs", "reads no reference"),
        ({"rl": "orpo", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing", "applies only with rl: dpo"),
    ],
)
def test_a_variant_key_with_another_rl_is_refused_naming_it(keys, key, says):
    with pytest.raises(RecipeError) as refused:
        recipe(**keys)
    line = next(line for line in str(refused.value).splitlines() if line.startswith(f"  - {key}:"))
    assert says in line


@pytest.mark.parametrize("type_", ["chatml.intel", "llama3.ultra", "chat_template.argilla_chat"])
def test_axolotls_preference_types_that_are_built_validate(type_):
    assert recipe(datasets=[{"path": "p.jsonl", "type": type_}]).is_preference


@pytest.mark.parametrize(
    "type_", ["user_defined.default", "zephyr.nectar", "mistral.argilla_chat", "chatml.default"]
)
def test_axolotls_other_preference_types_are_refused_naming_the_type_and_listing_cptunes(type_):
    with pytest.raises(RecipeError) as refused:
        recipe(datasets=[{"path": "p.jsonl", "type": type_}])
    message = str(refused.value)
    assert f"  - datasets[0].type: '{type_}' is not a preference (rl) dataset type cptune reads" in message
    assert (
        "cptune reads chat_template.default, chat_template.argilla_chat, passthrough.default, chatml.argilla,"
        in message
    )
    assert "llama3.ultra." in message
