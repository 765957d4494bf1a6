"""Axolotl's FSDP1 keys mapped onto FSDP2 (cptune.config.axolotl.fsdp1): the mapping, the notes, the refusals."""

import pytest

from cptune.config.axolotl.notes import axolotl_notes
from cptune.config.loader import validate_recipe
from cptune.config.recipe import Recipe
from tests.config.test_loader import MINIMAL, problems

# The fsdp block of Axolotl's examples/qwen2/qlora-fsdp.yaml (tests/axolotl/recipes/qwen2--qlora-fsdp.yaml).
AXOLOTL_FSDP1 = {
    "fsdp": ["full_shard", "auto_wrap"],
    "fsdp_config": {
        "fsdp_limit_all_gathers": True,
        "fsdp_sync_module_states": True,
        "fsdp_offload_params": True,
        "fsdp_use_orig_params": False,
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer",
        "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_sharding_strategy": "FULL_SHARD",
    },
}


def test_axolotl_fsdp1_block_runs_as_fsdp2_and_validate_says_what_each_key_means():
    recipe = validate_recipe({**MINIMAL, **AXOLOTL_FSDP1})
    assert recipe.is_fsdp and recipe.fsdp_version == 2
    settings = recipe.resolved_fsdp_config
    assert settings.reshard_after_forward is True and settings.offload_params is True
    assert settings.transformer_layer_cls_to_wrap == ("Qwen2DecoderLayer",)
    notes = "\n".join(axolotl_notes(recipe))
    for line in (
        "fsdp: [full_shard, auto_wrap] is Axolotl's FSDP1 form; cptune runs it with FSDP2: fsdp_version: 2, "
        "reshard_after_forward: true, offload_params: true; every decoder layer is its own FSDP unit (auto_wrap).",
        "fsdp_config.sharding_strategy: FULL_SHARD is FSDP1's; with FSDP2 it is reshard_after_forward: true.",
        "fsdp_config.limit_all_gathers is not used: it rate-limits FSDP1's all-gathers",
        "fsdp_config.use_orig_params is not used: FSDP2 always keeps the original parameters",
        "fsdp_config.sync_module_states is not used: every process loads the same base weights",
        "fsdp_config.cpu_ram_efficient_loading is not used: every process loads the base model",
    ):
        assert line in notes


@pytest.mark.parametrize(
    ("fsdp", "strategy", "reshard"),
    [
        ("full_shard auto_wrap", None, True),  # transformers' space-separated string
        (["shard_grad_op", "auto_wrap"], None, False),
        (None, "SHARD_GRAD_OP", False),
        (None, 2, False),  # FSDP1's enum number, as accelerate's configs write it
        (None, "1", True),
        (["auto_wrap"], None, True),  # no strategy: FSDP's default, FULL_SHARD
    ],
)
def test_strategy_maps_onto_reshard_after_forward(fsdp, strategy, reshard):
    data = {**MINIMAL, "fsdp_version": 2} if fsdp is None else {**MINIMAL, "fsdp": fsdp}
    if strategy is not None:
        data["fsdp_config"] = {"sharding_strategy": strategy}
    recipe = validate_recipe(data)
    assert recipe.is_fsdp
    assert recipe.resolved_fsdp_config.reshard_after_forward is reshard
    assert recipe.resolved_fsdp_config.offload_params is False


def test_hybrid_shard_needs_dp_replicate_size_and_then_maps_onto_hsdp():
    found = problems({**MINIMAL, "fsdp": ["hybrid_shard", "auto_wrap"]})
    assert found["fsdp"].startswith(
        "hybrid_shard shards within a group of ranks and replicates across groups"
    )
    assert "dp_replicate_size" in found["fsdp"]
    found = problems({**MINIMAL, "fsdp_version": 2, "fsdp_config": {"sharding_strategy": 4}})
    assert found["fsdp_config.sharding_strategy"].startswith("HYBRID_SHARD shards within a group")
    recipe = validate_recipe({**MINIMAL, "fsdp": "hybrid_shard_zero2", "dp_replicate_size": 2})
    assert recipe.resolved_fsdp_config.reshard_after_forward is False


def test_no_shard_is_plain_data_parallelism():
    found = problems({**MINIMAL, "fsdp": ["no_shard"]})
    assert found["fsdp"] == (
        "no_shard is plain data parallelism (every rank holds the whole model), which cptune runs without FSDP: "
        "remove fsdp, fsdp_config and fsdp_version."
    )


def test_contradictions_name_both_keys():
    found = problems({**MINIMAL, "fsdp": ["full_shard", "auto_wrap"], "fsdp_version": 1})
    assert found["fsdp_version"].startswith(
        "is 1, but fsdp: [full_shard, auto_wrap] asks for sharding that cptune runs with FSDP2 only; remove "
        "fsdp_version"
    )
    found = problems({**MINIMAL, "fsdp": ["full_shard", "shard_grad_op"]})
    assert found["fsdp"] == "[full_shard, shard_grad_op] lists 2 sharding strategies; keep one."
    found = problems(
        {**MINIMAL, "fsdp": "full_shard", "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP"}}
    )
    assert found["fsdp_config.sharding_strategy"].startswith(
        "SHARD_GRAD_OP disagrees with fsdp: full_shard: one frees each layer's gathered weights"
    )
    found = problems(
        {
            **MINIMAL,
            "fsdp_version": 2,
            "fsdp_config": {"sharding_strategy": 1, "reshard_after_forward": False},
        }
    )
    assert found["fsdp_config.reshard_after_forward"].startswith(
        "false disagrees with fsdp_config.sharding_strategy: FULL_SHARD"
    )
    found = problems({**MINIMAL, "fsdp": ["full_shard", "offload"], "fsdp_config": {"offload_params": False}})
    assert found["fsdp_config.offload_params"] == (
        "is false, but fsdp: [full_shard, offload] asks for offload; keep one of them."
    )


def test_an_empty_fsdp_is_not_set():
    for empty in (None, "", []):
        for recipe in (
            validate_recipe({**MINIMAL, "fsdp": empty}),
            Recipe.model_validate({**MINIMAL, "fsdp": empty}),
        ):
            assert not recipe.is_fsdp and recipe.fsdp is None and recipe.fsdp_version is None


def test_agreeing_keys_and_unknown_options():
    recipe = validate_recipe(
        {**MINIMAL, "fsdp": ["shard_grad_op", "offload"], "fsdp_config": {"reshard_after_forward": False}}
    )
    assert recipe.resolved_fsdp_config.offload_params is True
    found = problems({**MINIMAL, "fsdp": ["full_shard", "auto_wrapp"]})
    assert "'auto_wrap'" in found["fsdp[1]"]


def test_quantized_bases_under_fsdp2():
    """A 4-bit base trains under FSDP2 (its weights kept whole on every rank); an 8-bit base is refused."""
    qlora = {**MINIMAL, "adapter": "qlora", "load_in_4bit": True}
    assert validate_recipe({**qlora, **AXOLOTL_FSDP1}).is_quantized
    assert validate_recipe({**qlora, "fsdp_version": 2}).is_fsdp
    found = problems({**MINIMAL, "adapter": "lora", "load_in_8bit": True, "fsdp": "full_shard"})
    assert found["load_in_8bit"].startswith(
        "an 8-bit base cannot be trained under FSDP2 (fsdp_version: 2 or fsdp)"
    )
