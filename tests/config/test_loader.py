import pytest

from cptune.config.loader import (
    load_recipe,
    parse_override,
    read_recipe_file,
    set_by_path,
    validate_recipe,
)
from cptune.errors import RecipeError
from cptune.parallel.backends.table import backend_for
from cptune.parallel.backends.zero import trains_on_deepspeed

MINIMAL = {"base_model": "m", "datasets": [{"path": "d.jsonl"}]}


def problems(data):
    with pytest.raises(RecipeError) as info:
        validate_recipe(data)
    return {p.key: p.message for p in info.value.problems}


def test_minimal_recipe_gets_defaults_and_is_frozen():
    recipe = validate_recipe(MINIMAL)
    assert recipe.context_parallel_size == 1
    assert recipe.cp_backend == "ring-flash-attn"
    # No type: Axolotl's pre-tokenized rows (input_ids, labels), not alpaca.
    assert recipe.datasets[0].type is None and recipe.datasets[0].row_format == "pretokenized"
    with pytest.raises(Exception, match="frozen"):
        recipe.sequence_len = 5


def test_typo_gets_a_suggestion_with_its_key_path():
    found = problems({**MINIMAL, "sequnce_len": 12, "datasets": [{"path": "d", "feild": "x"}]})
    assert found["sequnce_len"] == "is not a known key. Did you mean 'sequence_len'?"
    assert found["datasets[0].feild"] == "is not a known key. Did you mean 'field'?"


def test_unsupported_axolotl_key_says_so():
    found = problems({**MINIMAL, "gptq": True, "sequence_parallel_degree": 2, "sage_attention": True})
    assert found["gptq"].startswith("is an Axolotl key that cptune does not support")
    assert "context_parallel_size" in found["sequence_parallel_degree"]
    # Any other key of Axolotl's schema is refused as such, not guessed at as a typo.
    assert found["sage_attention"] == (
        "is an Axolotl key that cptune does not support: it has no counterpart in cptune; remove it "
        "(an empty value or false is accepted as not set)."
    )


def test_keys_of_axolotls_example_recipes_get_advice():
    """Keys that Axolotl's shipped LoRA recipes set name cptune's equivalent, not just "unknown key"."""
    found = problems({**MINIMAL, "use_mlflow": True, "hub_model_id": "me/model"})
    assert all(m.startswith("is an Axolotl key that cptune does not support") for m in found.values())
    assert "heavy dependency" in found["use_mlflow"]
    assert "upload output_dir yourself" in found["hub_model_id"]
    assert set(found) == {"use_mlflow", "hub_model_id"}


def test_axolotls_revision_of_model_is_the_model_revision():
    """Axolotl names the hub revision of base_model revision_of_model; the same revision under both names is
    one key, two revisions are refused naming both."""
    assert validate_recipe({**MINIMAL, "revision_of_model": "v1.2"}).model_revision == "v1.2"
    assert (
        validate_recipe({**MINIMAL, "revision_of_model": "v1", "model_revision": "v1"}).model_revision == "v1"
    )
    found = problems({**MINIMAL, "revision_of_model": "v1", "model_revision": "v2"})
    assert set(found) == {"revision_of_model"}
    assert found["revision_of_model"] == (
        "is Axolotl's other name for model_revision, which the recipe also sets, to another value; keep one of the "
        "two."
    )


def test_wrong_type_names_the_value():
    found = problems({**MINIMAL, "micro_batch_size": "abc"})
    assert "valid integer" in found["micro_batch_size"] and "'abc'" in found["micro_batch_size"]


def test_literal_typo_gets_a_suggestion():
    found = problems({**MINIMAL, "datasets": [{"path": "d", "type": "alpca"}]})
    assert found["datasets[0].type"].endswith("Did you mean 'alpaca'?")


def test_all_problems_reported_together_field_and_combination():
    found = problems(
        {
            **MINIMAL,
            "lora_r": 0,
            "micro_batch_size": "x",
            "warmup_steps": 3,
            "warmup_ratio": 0.1,
            "typo_key": 1,
        }
    )
    assert set(found) == {"lora_r", "micro_batch_size", "warmup_ratio", "typo_key"}


def test_missing_required_key():
    found = problems({"datasets": [{"path": "d"}]})
    assert found["base_model"] == "is required but missing."


def test_deepspeed_refuses_what_its_core_attention_would_train_wrong():
    ulysses = {**MINIMAL, "cp_backend": "deepspeed", "context_parallel_size": 2}
    found = problems(
        {**ulysses, "ulysses_attn_implementation": "sdpa", "sample_packing": True, "causal": False}
    )
    assert "cannot keep packed samples apart" in found["sample_packing"]
    assert "ulysses_attn_implementation: cptune" in found["sample_packing"]
    assert "causally only" in found["ulysses_attn_implementation"]
    found = problems(
        {
            **ulysses,
            "ulysses_attn_implementation": "flash_attention_2",
            "sample_packing": True,
            "micro_batch_size": 2,
        }
    )
    assert "micro_batch_size: 1" in found["micro_batch_size"]
    # cptune's document-aware core attention (the default) takes packed and bidirectional rows.
    ok = validate_recipe({**ulysses, "sample_packing": True, "causal": False, "micro_batch_size": 2})
    assert ok.resolved_ulysses_attn_implementation == "cptune"


def test_deepspeed_keys_run_every_backend_under_zero_and_cp1_next_to_data_parallelism():
    found = problems(
        {**MINIMAL, "zero_stage": 2, "ulysses_attn_implementation": "sdpa", "deepspeed": "ds.json"}
    )
    assert set(found) == {"ulysses_attn_implementation"}
    assert found["ulysses_attn_implementation"] == "applies only to cp_backend: deepspeed; remove it."
    # At cp=1 (Axolotl's ZeRO recipes without CP) the local backend trains under ZeRO, whatever cp_backend says.
    for backend in ("ring-flash-attn", "torch", "deepspeed"):
        recipe = validate_recipe({**MINIMAL, "cp_backend": backend, "zero_stage": 2})
        assert (
            trains_on_deepspeed(backend_for(recipe), recipe) and backend_for(recipe).zero_stage(recipe) == 2
        )
    found = problems({**MINIMAL, "zero_stage": 3, "fsdp_version": 2})
    assert set(found) == {"fsdp_version"} and "choose one" in found["fsdp_version"]
    # Ring-flash-attn or torch CP under ZeRO (Axolotl's `deepspeed: zero3.json` next to context_parallel_size)
    # runs on DeepSpeed's engine; with FSDP2 as well it is refused: one engine shards the model states.
    for backend in ("ring-flash-attn", "torch"):
        recipe = validate_recipe(
            {**MINIMAL, "context_parallel_size": 2, "cp_backend": backend, "zero_stage": 2}
        )
        assert (
            trains_on_deepspeed(backend_for(recipe), recipe) and backend_for(recipe).zero_stage(recipe) == 2
        )
    plain = validate_recipe({**MINIMAL, "context_parallel_size": 2})
    assert not trains_on_deepspeed(backend_for(plain), plain) and backend_for(plain).zero_stage(plain) is None
    found = problems({**MINIMAL, "context_parallel_size": 2, "deepspeed": "zero3.json", "fsdp_version": 2})
    assert set(found) == {"fsdp_version"} and "choose one" in found["fsdp_version"]
    # The tiled MLP and the chunked loss run under ZeRO-3 (tests/parallel/test_ulysses_parity.py), for every backend.
    for backend in ("ring-flash-attn", "deepspeed"):
        keys = {"cp_backend": backend, "zero_stage": 3, "tiled_mlp": True, "cut_cross_entropy": True}
        recipe = validate_recipe({**MINIMAL, "context_parallel_size": 2, **keys})
        assert recipe.tiled_mlp and recipe.resolved_head_loss and recipe.zero_stage == 3
    recipe = validate_recipe(
        {
            **MINIMAL,
            "cp_backend": "deepspeed",
            "context_parallel_size": 2,
            "zero_stage": 3,
            "deepspeed": "ds.json",
        }
    )
    assert (recipe.zero_stage, recipe.deepspeed) == (3, "ds.json")  # Axolotl's `deepspeed` key is ours now


def test_torch_backend_refuses_what_it_would_train_wrong_with_reason_and_alternative():
    torch_cp = {**MINIMAL, "cp_backend": "torch", "context_parallel_size": 2}
    found = problems({**torch_cp, "sample_packing": True})
    assert "cannot keep packed samples apart" in found["sample_packing"]
    assert "cp_backend: ring-flash-attn" in found["sample_packing"]
    found = problems({**torch_cp, "causal": False, "cp_load_balance": True, "pad_to_sequence_len": True})
    assert "cp_load_balance: false" in found["cp_load_balance"]
    assert "cp_backend: ring-flash-attn" in found["pad_to_sequence_len"]
    # with cp=1 the backend is never used, so packing stays allowed
    assert validate_recipe({**torch_cp, "context_parallel_size": 1, "sample_packing": True})


def test_torch_backend_keys_and_their_defaults():
    torch_cp = {**MINIMAL, "cp_backend": "torch", "context_parallel_size": 2}
    causal = validate_recipe(torch_cp)
    assert (causal.resolved_cp_load_balance, causal.resolved_cp_comm_strategy) == (True, "allgather")
    bidirectional = validate_recipe({**torch_cp, "causal": False, "cp_comm_strategy": "alltoall"})
    assert not bidirectional.resolved_cp_load_balance
    assert bidirectional.resolved_cp_comm_strategy == "alltoall"
    # load balancing cuts each row into 2·cp chunks
    assert "sequence_len" in problems({**torch_cp, "sequence_len": 3})
    assert validate_recipe({**torch_cp, "sequence_len": 3, "cp_load_balance": False})
    found = problems({**MINIMAL, "cp_comm_strategy": "alltoall", "cp_load_balance": False})
    only_torch = "applies only to cp_backend: torch; remove it."
    assert found["cp_comm_strategy"] == found["cp_load_balance"] == only_torch


def test_zigzag_combinations_give_reason_and_alternative():
    found = problems(
        {**MINIMAL, "ring_attn_func": "batch_zigzag", "sample_packing": True, "context_parallel_size": 2}
    )
    assert "varlen_llama3" in found["ring_attn_func"]
    ok = validate_recipe(
        {**MINIMAL, "ring_attn_func": "batch_zigzag", "bf16": True, "context_parallel_size": 2}
    )
    assert ok.resolved_ring_attn_func == "batch_zigzag"


def test_zigzag_in_fp32_is_refused():
    found = problems({**MINIMAL, "ring_attn_func": "batch_zigzag", "context_parallel_size": 2})
    assert "bf16: true" in found["ring_attn_func"]


def test_sequence_shorter_than_cp_chunks():
    found = problems({**MINIMAL, "sequence_len": 3, "context_parallel_size": 4})
    assert "cannot be split" in found["sequence_len"]


def test_overrides_parse_types_and_nested_paths(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("base_model: m\ndatasets:\n  - path: a.jsonl\n")
    recipe = load_recipe(
        path, ["--datasets.0.path=b.jsonl", "--sample_packing=true", "lora_r=4", "--adapter=lora"]
    )
    assert recipe.datasets[0].path == "b.jsonl"
    assert recipe.sample_packing is True and recipe.lora_r == 4 and recipe.is_lora


def test_override_errors():
    with pytest.raises(RecipeError, match="not of the form"):
        parse_override("--nothing")
    with pytest.raises(RecipeError, match="out of range"):
        set_by_path({"datasets": [{}]}, "datasets.3.path", "x")
    with pytest.raises(
        RecipeError, match=r"sequence_len holds a value of type int, which has no keys; override "
    ):
        set_by_path({"sequence_len": 128}, "sequence_len.x", 1)


def test_val_set_size_of_one_or_more_counts_whole_rows():
    assert "must be a whole number" in problems({**MINIMAL, "val_set_size": 2.5})["val_set_size"]
    for fine in (0.05, 1, 25):
        assert validate_recipe({**MINIMAL, "val_set_size": fine}).val_set_size == fine


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("base_model: m\ndatasets: [\n  - : :\n")
    with pytest.raises(RecipeError, match="not valid YAML at line"):
        load_recipe(path)


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    marker = tmp_path / "hacked"
    path.write_text(f"base_model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(
        RecipeError, match=r"the YAML tag '!!python/object/apply:os.system' .* is not allowed"
    ):
        load_recipe(path)
    assert not marker.exists()


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_a_key_written_twice_is_refused_at_any_depth(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("base_model: m\ndatasets:\n  - path: a.jsonl\n    type: alpaca\n    path: b.jsonl\n")
    with pytest.raises(RecipeError, match=r"line 5, .*the key 'path' appears twice .*\(first at line 3\)"):
        load_recipe(path)


def test_a_merged_key_may_still_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(
        "base_model: m\ndefaults: &data {path: a.jsonl, type: alpaca}\n"
        "datasets:\n  - <<: *data\n    path: b.jsonl\n"
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    # Only the unknown 'defaults' key is wrong: the merge and its override are read as written.
    assert [p.key for p in info.value.problems] == ["defaults"]
    data = read_recipe_file(path)
    assert data["datasets"] == [{"path": "b.jsonl", "type": "alpaca"}]


def test_a_folder_is_not_a_recipe(tmp_path):
    with pytest.raises(RecipeError, match="is a folder, not a recipe file"):
        load_recipe(tmp_path)


def test_axolotls_low_cpu_mem_usage_is_accepted_either_way():
    """transformers 5 ignores low_cpu_mem_usage (from_pretrained drops it: it always loads without a second copy)."""
    import inspect
    import re

    from transformers import modeling_utils

    source = inspect.getsource(modeling_utils.PreTrainedModel.from_pretrained)
    dropped = r'for name in \[[^\]]*"low_cpu_mem_usage"[^\]]*\]:\s*_ = kwargs\.pop\(name, None\)'
    assert re.search(dropped, source), "transformers reads low_cpu_mem_usage again: revisit the key"
    for value in (True, False):
        assert validate_recipe({**MINIMAL, "low_cpu_mem_usage": value}).low_cpu_mem_usage is value


def test_axolotls_model_config_is_overrides_of_model_config():
    """Axolotl's schema reads overrides_of_model_config under the name model_config too (its Mixtral recipes
    write model_config: {output_router_logits: true})."""
    overrides = {"output_router_logits": True}
    recipe = validate_recipe({**MINIMAL, "model_config": overrides})
    assert recipe.overrides_of_model_config == overrides
    found = problems(
        {**MINIMAL, "model_config": overrides, "overrides_of_model_config": {"use_cache": False}}
    )
    assert set(found) == {"model_config"}
    assert found["model_config"].startswith("is Axolotl's other name for overrides_of_model_config")


def test_keys_of_axolotls_integrations_are_named_as_such():
    """Keys that Axolotl's plugins add (its MoE kernels' use_scattermoe, SwanLab's, ...) are not typos: the
    message names the integration; false or an empty value is accepted as not set."""
    found = problems(
        {**MINIMAL, "use_scattermoe": True, "kd_alpha": 0.5, "use_sonicmoe": False, "swanlab_mode": None}
    )
    assert set(found) == {"use_scattermoe", "kd_alpha"}
    assert found["use_scattermoe"] == (
        "is a key of Axolotl's kernels integration (a plugin), which cptune does not run; remove it (an empty value, "
        "or false for a switch, is accepted as not set)."
    )
    assert "Axolotl's kd integration" in found["kd_alpha"]


def test_axolotls_batch_size_is_read_only_as_a_row_count():
    """batch_size 0 or negative is refused as itself, not as a gradient_accumulation_steps the recipe never wrote."""
    found = problems({**MINIMAL, "batch_size": 0})
    assert set(found) == {"batch_size"}
    found = problems({**MINIMAL, "batch_size": -4, "micro_batch_size": 2})
    assert set(found) == {"batch_size"}
    assert problems({**MINIMAL, "evaluation_strategy": "steps"})["evaluation_strategy"].endswith(
        "Axolotl's older name for eval_strategy; rename it."
    )


def test_ulysses_refuses_an_evaluation_batch_larger_than_the_training_batch():
    ulysses = {**MINIMAL, "context_parallel_size": 2, "cp_backend": "deepspeed"}
    found = problems({**ulysses, "eval_batch_size": 4})
    assert set(found) == {"eval_batch_size"}
    assert found["eval_batch_size"].startswith(
        "4 is more rows than micro_batch_size (1): DeepSpeed's Ulysses"
    )
    assert validate_recipe({**ulysses, "eval_batch_size": 2, "micro_batch_size": 2}).eval_batch_size == 2
    assert validate_recipe({**MINIMAL, "context_parallel_size": 2, "eval_batch_size": 4}).eval_batch_size == 4


def test_zero_without_cp_plans_deepspeeds_engine_and_its_patches():
    """deepspeed / zero_stage at cp=1 over 2 processes: DeepSpeed's engine with the recipe's stage, its config on
    the Trainer, ZeRO's state layout, the engine patches; not the loader's CP-batch patch (no CP group)."""
    from cptune.run.plan import RunPlan

    recipe = validate_recipe({**MINIMAL, "zero_stage": 3})
    plan = RunPlan.build(recipe, 2)
    assert plan.on_deepspeed and plan.zero_stage() == 3
    assert plan.trainer_parallelism().deepspeed["zero_optimization"]["stage"] == 3
    selected = {p.name for p in plan.patches.plan(recipe).selected}
    assert {"deepspeed-skip-cpu-shm-op", "accelerate-deepspeed-cpu-world-size"} <= selected
    assert "accelerate-deepspeed-loader-cp-batches" not in selected
    plain = RunPlan.build(validate_recipe(MINIMAL), 2)
    assert (
        not plain.on_deepspeed
        and plain.zero_stage() is None
        and plain.trainer_parallelism().deepspeed is None
    )
