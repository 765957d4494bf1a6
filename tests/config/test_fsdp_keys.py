"""The FSDP2 keys: Axolotl's spellings accepted, what cptune cannot do refused with the reason."""

from cptune.config.loader import validate_recipe
from tests.config.test_loader import MINIMAL, problems


def test_axolotl_fsdp2_block_is_accepted_with_and_without_the_fsdp_prefix():
    recipe = validate_recipe(
        {
            **MINIMAL,
            "fsdp_version": 2,
            "fsdp_config": {
                "fsdp_reshard_after_forward": False,
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "transformer_layer_cls_to_wrap": "LlamaDecoderLayer, MistralDecoderLayer",
                "fsdp_activation_checkpointing": True,
                "state_dict_type": "SHARDED_STATE_DICT",
            },
            "dp_shard_size": 2,
            "context_parallel_size": 2,
        }
    )
    assert recipe.is_fsdp
    assert recipe.fsdp_config.reshard_after_forward is False
    assert recipe.fsdp_config.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer", "MistralDecoderLayer")
    # activation_checkpointing is the same switch as gradient_checkpointing.
    assert recipe.resolved_gradient_checkpointing and not recipe.gradient_checkpointing
    assert recipe.default_process_count == 4


def test_default_process_count_follows_the_layout():
    assert validate_recipe({**MINIMAL, "context_parallel_size": 2}).default_process_count == 2
    fsdp = {**MINIMAL, "fsdp_version": 2, "context_parallel_size": 2}
    assert validate_recipe(fsdp).default_process_count == 2
    assert validate_recipe({**fsdp, "dp_shard_size": 2, "dp_replicate_size": 2}).default_process_count == 8


def test_fsdp1_and_fsdp_keys_without_fsdp_are_refused():
    found = problems({**MINIMAL, "fsdp_version": 1})
    assert found["fsdp_version"].startswith("FSDP1 is not supported")
    assert "fsdp_version: 2" in found["fsdp_version"]
    found = problems({**MINIMAL, "fsdp_config": {}, "dp_shard_size": 2, "dp_replicate_size": 2})
    assert set(found) == {"fsdp_config", "dp_shard_size", "dp_replicate_size"}
    assert all(message.startswith("applies only with fsdp_version: 2") for message in found.values())


def test_deepspeed_shards_with_zero_not_fsdp():
    found = problems({**MINIMAL, "fsdp_version": 2, "cp_backend": "deepspeed", "context_parallel_size": 2})
    assert "use zero_stage: 3" in found["fsdp_version"]


def test_full_state_dict_is_accepted_since_cptune_always_gathers_the_final_model():
    """Axolotl's FSDP2 recipes set it; it was refused, though cptune saves the final model whole anyway."""
    recipe = validate_recipe(
        {**MINIMAL, "fsdp_version": 2, "fsdp_config": {"state_dict_type": "FULL_STATE_DICT"}}
    )
    assert recipe.resolved_fsdp_config.state_dict_type == "FULL_STATE_DICT"


def test_fsdp1_only_settings_and_typos_inside_fsdp_config():
    found = problems(
        {
            **MINIMAL,
            "fsdp_version": 2,
            "fsdp_config": {"fsdp_backward_prefetch": "BACKWARD_PRE", "reshard_after_foward": True},
        }
    )
    assert found["fsdp_config.backward_prefetch"] == (
        "is an Axolotl key that cptune does not support: an FSDP1 setting with no FSDP2 counterpart; remove it."
    )
    assert (
        found["fsdp_config.reshard_after_foward"]
        == "is not a known key. Did you mean 'reshard_after_forward'?"
    )


def test_the_same_key_with_and_without_prefix_is_refused():
    found = problems(
        {**MINIMAL, "fsdp_version": 2, "fsdp_config": {"fsdp_offload_params": True, "offload_params": False}}
    )
    assert found["fsdp_config"] == (
        "'fsdp_offload_params' and 'offload_params' are the same key (with and without the fsdp_ prefix); "
        "keep one of them."
    )


def test_the_fsdp_version_inside_fsdp_config_is_axolotls_second_place_for_it():
    """Axolotl reads fsdp_config.version (or fsdp_version) when the top level has none (13 of its examples)."""
    for key in ("version", "fsdp_version"):
        recipe = validate_recipe({**MINIMAL, "fsdp_config": {key: 2, "offload_params": True}})
        assert recipe.is_fsdp and recipe.fsdp_config.offload_params
        same = validate_recipe({**MINIMAL, "fsdp_version": 2, "fsdp_config": {key: 2}})
        assert same.is_fsdp
    found = problems({**MINIMAL, "fsdp_version": 2, "fsdp_config": {"version": 1}})
    assert found["fsdp_config.version"].endswith(
        "it differs from fsdp_version at the top level of the recipe; keep one of them."
    )
    assert problems({**MINIMAL, "fsdp_config": {"version": 1}})["fsdp_version"].startswith(
        "FSDP1 is not supported"
    )
