"""Keys of Axolotl recipes: empty placeholders, QLoRA, trackers, tokens, and keys cptune maps or refuses."""

from __future__ import annotations

import pytest

from cptune.config.axolotl.notes import axolotl_notes
from cptune.config.loader import load_recipe, validate_recipe
from cptune.errors import RecipeError

MINIMAL = {"base_model": "m", "datasets": [{"path": "d.jsonl"}]}


def problems(data):
    with pytest.raises(RecipeError) as info:
        validate_recipe(data)
    return {p.key: p.message for p in info.value.problems}


def test_empty_values_of_known_keys_mean_not_set():
    """Axolotl's examples leave keys empty as placeholders (`lora_model_dir:`, `wandb_project:` ...)."""
    recipe = validate_recipe(
        {
            **MINIMAL,
            "dataset_prepared_path": None,  # cptune's own key: its default
            "max_grad_norm": None,
            "wandb_project": None,  # a key cptune maps
            "lora_model_dir": None,
            "special_tokens": None,
            "fp16": None,
            "hub_model_id": None,  # an Axolotl key cptune refuses when set
            "gpu_memory_limit": None,
            "torch_compile_backend": None,  # any key of Axolotl's schema
            "datasets": [{"path": "d.jsonl", "type": None, "field": None, "shards": None}],
            "fsdp_version": 2,
            "fsdp_config": {
                "fsdp_offload_params": None,
                "sync_module_states": None,
                "reshard_after_forward": None,
            },
            "bnb_config_kwargs": None,
        }
    )
    assert recipe.dataset_prepared_path == "prepared" and recipe.max_grad_norm == 1.0
    assert recipe.wandb_project is None and not recipe.wandb_enabled and recipe.fp16 is False
    assert recipe.datasets[0].type is None and recipe.resolved_fsdp_config.reshard_after_forward


def test_empty_typo_still_fails_with_a_suggestion():
    found = problems({**MINIMAL, "wandb_projetc": None, "datasets": [{"path": "d", "feild": None}]})
    assert found["wandb_projetc"] == "is not a known key. Did you mean 'wandb_project'?"
    assert found["datasets[0].feild"] == "is not a known key. Did you mean 'field'?"


def test_false_switches_cptune_lacks_are_accepted_and_true_ones_refused():
    assert validate_recipe(
        {**MINIMAL, "group_by_length": False, "flash_attn_rms_norm": False, "strict": False}
    )
    found = problems({**MINIMAL, "group_by_length": True, "layer_offloading": True})
    assert "length grouping is not supported" in found["group_by_length"]
    assert "it has no counterpart in cptune" in found["layer_offloading"]


def test_qlora_and_8bit_keys():
    qlora = validate_recipe(
        {
            **MINIMAL,
            "adapter": "qlora",
            "load_in_4bit": True,
            "load_in_8bit": False,
            "bnb_config_kwargs": {"bnb_4bit_use_double_quant": False, "llm_int8_skip_modules": "lm_head"},
        }
    )
    assert qlora.is_lora and qlora.is_quantized
    assert qlora.bnb_config_kwargs.llm_int8_skip_modules == ("lm_head",)
    assert validate_recipe({**MINIMAL, "adapter": "lora", "load_in_8bit": True}).is_quantized
    found = problems({**MINIMAL, "adapter": "qlora", "load_in_8bit": True})
    assert "set load_in_4bit: true" in found["adapter"]
    assert "use load_in_4bit with qlora" in found["load_in_8bit"]


def test_wandb_and_tensorboard_switches_resolve_to_the_trainers_loggers():
    recipe = validate_recipe({**MINIMAL, "wandb_project": "p", "wandb_watch": False, "use_tensorboard": True})
    assert recipe.resolved_report_to == ("tensorboard", "wandb")
    assert recipe.wandb_watch == "false"  # W&B reads the text
    assert validate_recipe(MINIMAL).resolved_report_to == ()


@pytest.mark.parametrize(
    ("keys", "eval_steps", "save_steps"),
    [
        ({"evals_per_epoch": 4, "saves_per_epoch": 1, "val_set_size": 0.1}, 0.25, None),
        ({"evals_per_epoch": 2, "saves_per_epoch": 2, "num_epochs": 2, "val_set_size": 0.1}, 0.25, 0.25),
        ({"evals_per_epoch": 4}, None, None),  # no evaluation data: no evaluation (Axolotl does the same)
        ({"eval_steps": 7, "save_steps": 3, "val_set_size": 0.1}, 7, 3),
    ],
)
def test_per_epoch_counts_become_shares_of_the_run(keys, eval_steps, save_steps):
    recipe = validate_recipe({**MINIMAL, **keys})
    assert (recipe.resolved_eval_steps, recipe.resolved_save_steps) == (eval_steps, save_steps)


def test_optimizers_pass_through_by_the_trainers_names():
    for name in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "adamw_torch_8bit", "lion_32bit"):
        assert validate_recipe({**MINIMAL, "optimizer": name}).optimizer == name
    assert "Input should be" in problems({**MINIMAL, "optimizer": "muon"})["optimizer"]


def test_optimizer_names_are_the_trainers():
    from typing import get_args

    from transformers.training_args import OptimizerNames

    from cptune.config.training import OptimizerName

    assert set(get_args(OptimizerName)) == {n.value for n in OptimizerNames}


def test_chat_template_names_and_jinja():
    assert validate_recipe({**MINIMAL, "chat_template": "llama3"}).chat_template == "llama3"
    assert validate_recipe({**MINIMAL, "chat_template_jinja": "{{ messages }}"}).chat_template is None
    assert validate_recipe({**MINIMAL, "chat_template": "qwen3"}).chat_template == "qwen3"
    found = problems({**MINIMAL, "chat_template": "deepseek_v3"})
    assert found["chat_template"].startswith("'deepseek_v3' is not a chat template cptune renders itself")
    assert "chat_template_jinja" in found["chat_template"]


def test_message_property_mappings_name_the_message_keys():
    recipe = validate_recipe(
        {
            **MINIMAL,
            "datasets": [
                {
                    "path": "d",
                    "type": "chat_template",
                    "field_messages": "conversations",
                    "message_property_mappings": {"role": "from", "content": "value"},
                }
            ],
        }
    )
    assert recipe.datasets[0].resolved_message_fields == ("from", "value")


def test_axolotls_deepspeed_config_without_cp_is_accepted():
    """Axolotl's ZeRO recipes without context parallelism (deepspeed: deepspeed_configs/zero2.json) train with
    ZeRO next to plain data parallelism (tests/run/test_deepspeed_runs.py trains one)."""
    recipe = validate_recipe({**MINIMAL, "deepspeed": "zero2.json"})
    assert recipe.deepspeed == "zero2.json" and recipe.context_parallel_size == 1


def test_the_two_loss_plugins_map_onto_the_chunked_loss_and_others_are_refused_one_line_each():
    plugins = [
        "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin",
        "axolotl.integrations.liger.LigerPlugin",
        "my.Plugin",
        "other.Plugin",
    ]
    found = problems(
        {**MINIMAL, "plugins": plugins, "liger_rope": True, "liger_fused_linear_cross_entropy": True}
    )
    assert set(found) == {"plugins[2]", "plugins[3]"}
    assert found["plugins[2]"].startswith("'my.Plugin': cptune runs no Axolotl plugins; remove it.")
    mapped = validate_recipe({**MINIMAL, "plugins": plugins[:2], "liger_fused_linear_cross_entropy": True})
    assert mapped.resolved_head_loss
    assert validate_recipe({**MINIMAL, "plugins": plugins[:1]}).resolved_head_loss
    assert not validate_recipe({**MINIMAL, "plugins": plugins[1:2]}).resolved_head_loss


def test_refusals_of_nested_sections_are_reported_with_other_key_errors():
    """A field error elsewhere must not hide what is wrong inside fsdp_config, nor refuse what is right there."""
    found = problems(
        {
            **MINIMAL,
            "typo_key": 1,
            "fsdp_version": 2,
            "fsdp_config": {"state_dict_type": "FULL_STATE_DICT", "backward_prefetch": "BACKWARD_PRE"},
        }
    )
    assert set(found) == {"typo_key", "fsdp_config.backward_prefetch"}


def test_mapped_keys_get_notes_where_cptune_means_something_else():
    recipe = validate_recipe(
        {
            **MINIMAL,
            "attn_implementation": "flash_attention_2",
            "tokenizer_type": "LlamaTokenizer",
            "tf32": True,
            "sample_packing": True,
            "eval_sample_packing": False,
            "evals_per_epoch": 4,
            "strict": False,
            "model_type": "AutoModelForCausalLM",
            "gradient_checkpointing_kwargs": {"use_reentrant": False},
            "fsdp_version": 2,
            "fsdp_config": {"fsdp_state_dict_type": "FULL_STATE_DICT"},
        }
    )
    notes = "\n".join(axolotl_notes(recipe))
    for fragment in (
        "attn_implementation: flash_attention_2 is not what picks the attention",
        "tokenizer_type: LlamaTokenizer is not used",
        "tf32: true applies on NVIDIA GPUs only",
        "eval_sample_packing: false is not used",
        "evals_per_epoch is not used: the recipe has no evaluation data",
        "FULL_STATE_DICT applies to the final model only",
    ):
        assert fragment in notes
    assert axolotl_notes(validate_recipe(MINIMAL)) == []


def test_axolotls_cpu_offloading_modes_map_onto_cptunes_activation_offloading():
    """ALST's recipes say activation_offloading: legacy; Axolotl reads gradient_checkpointing: offload as both."""
    for value in ("legacy", "hidden_states", True):
        recipe = validate_recipe({**MINIMAL, "gradient_checkpointing": True, "activation_offloading": value})
        assert recipe.offloads_activations
    note = axolotl_notes(
        validate_recipe({**MINIMAL, "gradient_checkpointing": True, "activation_offloading": "legacy"})
    )
    assert any(line.startswith("activation_offloading: legacy runs cptune's own offloading") for line in note)
    offload = validate_recipe(
        {**MINIMAL, "gradient_checkpointing": "offload", "activation_offloading": False}
    )
    assert offload.gradient_checkpointing is True and offload.offloads_activations
    assert not validate_recipe({**MINIMAL, "gradient_checkpointing": True}).offloads_activations
    found = problems({**MINIMAL, "gradient_checkpointing": True, "activation_offloading": "disk"})
    assert "'disk' (Axolotl's offloading to files) is not supported" in found["activation_offloading"]


def test_axolotls_fused_kernels_are_accepted_with_a_note_and_refused_where_dropout_would_differ():
    """lora_*_kernel and fused_attn_kernel compute what peft's layers compute, except for dropout masks."""
    kernels = {
        "lora_mlp_kernel": True,
        "lora_qkv_kernel": True,
        "lora_o_kernel": True,
        "fused_attn_kernel": True,
    }
    lora = {**MINIMAL, "adapter": "lora", **kernels}
    notes = "\n".join(axolotl_notes(validate_recipe(lora)))
    assert "lora_mlp_kernel, lora_qkv_kernel, lora_o_kernel: cptune runs peft's LoRA layers" in notes
    assert "fused_attn_kernel: cptune runs the model's own q/k RMSNorm and RoPE" in notes
    # With dropout, the fused MLP and q/k/v kernels share one mask: refused where they would apply.
    found = problems({**lora, "lora_dropout": 0.05})
    assert set(found) == {"lora_mlp_kernel", "lora_qkv_kernel"}
    assert found["lora_qkv_kernel"].startswith(
        "with lora_dropout: 0.05 Axolotl's kernel shares one dropout mask between q_proj, k_proj and v_proj"
    )
    assert "Set lora_dropout: 0" in found["lora_mlp_kernel"]
    # The MLP kernel fuses only where gate, up and down all carry the adapter (Axolotl's qwen3 32B recipe).
    partial = {**lora, "lora_dropout": 0.05, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "up_proj"]}
    assert set(problems(partial)) == {"lora_qkv_kernel"}
    assert validate_recipe({**lora, "lora_dropout": 0.05, "lora_qkv_kernel": False, "lora_mlp_kernel": False})


def test_axolotls_data_keys_are_accepted_with_their_meaning():
    """ds_type, eot_tokens, train_on_eot, shuffle_merged_datasets, and the alpaca family's type names."""
    recipe = validate_recipe(
        {
            **MINIMAL,
            "datasets": [
                {"path": "d.txt", "ds_type": "json", "type": "alpaca:chat"},
                {"path": "c.jsonl", "type": "chat_template", "train_on_eot": "last"},
                {"path": "p.jsonl"},
            ],
            "eot_tokens": "<|im_end|>",
            "shuffle_merged_datasets": False,
        }
    )
    first, chat, tokens = recipe.datasets
    assert (first.ds_type, first.row_format) == ("json", "alpaca")
    assert (chat.train_on_eos, chat.resolved_train_on_eot) == ("turn", "last")
    assert tokens.row_format == "pretokenized"
    assert recipe.eot_tokens == ("<|im_end|>",) and recipe.shuffle_merged_datasets is False
    assert validate_recipe({**MINIMAL, "shuffle_merged_datasets": True}).shuffle_merged_datasets
    for name in ("alpaca:instruct", "alpaca:chatml", "alpaca:phi", "alpaca_instruct.load_no_prompt"):
        assert (
            validate_recipe({**MINIMAL, "datasets": [{"path": "d", "type": name}]}).datasets[0].row_format
            == "alpaca"
        )
    found = problems({**MINIMAL, "datasets": [{"path": "d", "type": "alpaca:concise", "ds_type": "xml"}]})
    assert "alpaca:chat" in found["datasets[0].type"] and "json" in found["datasets[0].ds_type"]


def test_validate_notes_where_the_data_is_trained_differently():
    chat = {"datasets": [{"path": "c.jsonl", "type": "chat_template"}]}
    notes = axolotl_notes(validate_recipe({**MINIMAL, **chat, "chat_template": "mistral_v2v3"}))
    assert any(
        "chat_template: mistral_v2v3 writes a system message before the first user message" in n
        for n in notes
    )
    assert not axolotl_notes(validate_recipe({**MINIMAL, **chat, "chat_template": "chatml"}))
    completion = {
        "datasets": [{"path": "t.jsonl", "type": "completion"}],
        "excess_length_strategy": "truncate",
    }
    notes = axolotl_notes(validate_recipe({**MINIMAL, **completion}))
    assert any("excess_length_strategy: truncate does not apply to datasets[0]" in n for n in notes)
    notes = axolotl_notes(validate_recipe({**MINIMAL, "shuffle_merged_datasets": True}))
    assert any("shuffle_merged_datasets: true adds no shuffle" in n for n in notes)
    assert not axolotl_notes(validate_recipe({**MINIMAL, "shuffle_merged_datasets": False}))


@pytest.mark.parametrize(
    ("keys", "workers"),
    [
        ({}, None),
        ({"dataset_num_proc": 8}, 8),
        ({"dataset_processes": 4}, 4),
        ({"dataset_num_proc": 4, "dataset_processes": 4}, 4),
    ],
)
def test_axolotls_dataset_num_proc_sets_the_tokenization_workers(keys, workers):
    assert validate_recipe({**MINIMAL, **keys}).resolved_dataset_processes == workers


def test_ligers_layer_switches_run_the_models_own_layers_with_a_note():
    """LigerPlugin's kernels compute the layers they replace; cptune runs those layers and says so."""
    switches = {
        "liger_rope": True,
        "liger_rms_norm": True,
        "liger_glu_activation": True,
        "liger_layer_norm": False,
    }
    recipe = validate_recipe({**MINIMAL, "plugins": ["axolotl.integrations.liger.LigerPlugin"], **switches})
    assert not recipe.resolved_head_loss  # LigerPlugin alone does not turn the chunked loss on
    (note,) = [n for n in axolotl_notes(recipe) if n.startswith("liger_")]
    assert note.startswith(
        "liger_rope, liger_rms_norm, liger_glu_activation: cptune runs the model's own layers"
    )


def test_reentrant_checkpointing_runs_as_cptunes_non_reentrant_with_a_note():
    recipe = validate_recipe(
        {**MINIMAL, "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}
    )
    (note,) = [n for n in axolotl_notes(recipe) if n.startswith("gradient_checkpointing_kwargs")]
    assert "use_reentrant: true runs as use_reentrant: false" in note
    assert not [
        n
        for n in axolotl_notes(
            validate_recipe({**MINIMAL, "gradient_checkpointing_kwargs": {"use_reentrant": False}})
        )
        if n.startswith("gradient_checkpointing_kwargs")
    ]
    found = problems(
        {**MINIMAL, "gradient_checkpointing_kwargs": {"use_reentrant": True, "preserve_rng_state": False}}
    )
    assert "keep only use_reentrant or remove it" in found["gradient_checkpointing_kwargs"]


def test_attn_implementation_accepts_the_hubs_flash_attention_builds_only():
    """Axolotl's gpt-oss recipes name kernels-community/vllm-flash-attn3: a FlashAttention build, accepted as
    flash_attention_2/3 are (cptune picks the attention); other hub kernels and eager/flex are refused."""
    for name in ("kernels-community/vllm-flash-attn3", "kernels-community/flash-attn", "flash_attention_3"):
        notes = "\n".join(axolotl_notes(validate_recipe({**MINIMAL, "attn_implementation": name})))
        assert f"attn_implementation: {name} is not what picks the attention" in notes
    for name in ("kernels-community/sage-attention", "someone/flash-attn", "eager", "flex_attention"):
        found = problems({**MINIMAL, "attn_implementation": name})
        assert found["attn_implementation"].startswith(f"cptune does not run '{name}' attention"), found


def test_use_kernels_and_experimental_skip_move_to_device_are_accepted_with_notes():
    """gpt-oss's recipes set both. The Trainer places no model on a device before FSDP or DeepSpeed wraps it
    (transformers' Trainer.__init__), which is what experimental_skip_move_to_device asks Axolotl for."""
    import inspect
    import re

    from transformers import Trainer

    source = inspect.getsource(Trainer.__init__)
    skipped = re.search(
        r"or self\.is_deepspeed_enabled.*?or self\.is_fsdp_enabled.*?self\.place_model_on_device = False",
        source,
        re.S,
    )
    assert skipped, (
        "transformers' Trainer places models differently now: revisit experimental_skip_move_to_device"
    )
    recipe = validate_recipe({**MINIMAL, "use_kernels": True, "experimental_skip_move_to_device": True})
    notes = "\n".join(axolotl_notes(recipe))
    assert "use_kernels: cptune runs the model's own modules" in notes
    assert "experimental_skip_move_to_device: the Trainer never moves the whole model" in notes
    assert axolotl_notes(validate_recipe({**MINIMAL, "use_kernels": False})) == []


def test_quantize_moe_experts_is_a_qlora_key_with_checkpointing_and_no_sharding():
    qlora = {**MINIMAL, "adapter": "qlora", "load_in_4bit": True, "gradient_checkpointing": True}
    assert validate_recipe({**qlora, "quantize_moe_experts": True}).quantize_moe_experts
    assert not validate_recipe({**qlora, "quantize_moe_experts": False}).quantize_moe_experts

    def refusals(data):
        with pytest.raises(RecipeError) as info:
            validate_recipe(data)
        return [p.message for p in info.value.problems if p.key == "quantize_moe_experts"]

    assert refusals({**MINIMAL, "adapter": "lora", "load_in_8bit": True, "quantize_moe_experts": True}) == [
        "cptune stores a mixture of experts' expert weights in 4 bits only, under QLoRA: set load_in_4bit: true with "
        "adapter: qlora (with load_in_8bit the experts stay in the training dtype), or remove quantize_moe_experts.",
        "needs gradient_checkpointing: true: the backward recomputes each layer and dequantizes its experts again; "
        "without it every layer's dequantized experts would stay in memory until the backward, as much as "
        "unquantized experts.",
    ]
    assert refusals({**qlora, "quantize_moe_experts": True, "deepspeed": "zero3.json"}) == [
        "4-bit experts are not built for sharded weights (deepspeed): FSDP2 and DeepSpeed would split the packed "
        "experts apart from their quantization constants. Train without sharding (one GPU, or data parallelism "
        "with context parallelism), or remove quantize_moe_experts."
    ]
    assert any(
        "(fsdp_version)" in m for m in refusals({**qlora, "quantize_moe_experts": True, "fsdp_version": 2})
    )


def test_quantize_moe_experts_is_supported_in_the_axolotl_key_table(tmp_path):
    from devtools.docgen.axolotl_migration import key_table

    recipe = tmp_path / "qwen3--moe-qlora.yaml"
    recipe.write_text(
        "base_model: m\ndatasets:\n  - path: d.jsonl\nadapter: qlora\nload_in_4bit: true\n"
        "gradient_checkpointing: true\nquantize_moe_experts: true\n",
        encoding="utf-8",
    )
    rows = {key: outcomes for key, _, outcomes in key_table([recipe])}
    assert rows["quantize_moe_experts"] == ["supported"]


def test_axolotls_batch_size_sets_the_accumulation_or_must_agree_with_it():
    """Axolotl's normalize_config: gradient_accumulation_steps = batch_size // micro_batch_size when unset."""
    recipe = validate_recipe({**MINIMAL, "batch_size": 8, "micro_batch_size": 2})
    assert (recipe.micro_batch_size, recipe.gradient_accumulation_steps) == (2, 4)
    assert (
        validate_recipe({**MINIMAL, "batch_size": 4, "gradient_accumulation_steps": 4}).micro_batch_size == 1
    )
    found = problems({**MINIMAL, "batch_size": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 2})
    assert found["batch_size"] == (
        "8 is not micro_batch_size x gradient_accumulation_steps (2 x 2 = 4), the rows each process trains per "
        "optimizer step (Axolotl's meaning); set gradient_accumulation_steps: 4, or remove batch_size."
    )
    found = problems({**MINIMAL, "batch_size": 5, "micro_batch_size": 2})
    assert "choose a multiple of micro_batch_size 2" in found["batch_size"]


def test_save_and_eval_strategy_reach_the_trainer_and_need_a_period_for_steps(write_recipe):
    from cptune.run.plan import RunPlan
    from cptune.run.training.builder import training_arguments
    from cptune.run.training.distributed import DistEnv

    def args(**keys):
        return training_arguments(RunPlan.build(load_recipe(write_recipe(**keys)), 1), DistEnv())

    got = args(save_strategy="epoch", eval_strategy="epoch", val_set_size=0.1)
    assert (got.save_strategy, got.eval_strategy) == ("epoch", "epoch")
    got = args(save_strategy="steps", save_steps=5)
    assert (got.save_strategy, got.save_steps, got.eval_strategy) == ("steps", 5, "no")
    assert args(save_strategy="no").save_strategy == "no"
    assert args(save_steps=3).save_strategy == "steps"  # unset: steps when a period is given
    found = problems({**MINIMAL, "save_strategy": "steps"})
    assert found["save_strategy"] == (
        "steps needs how often: set save_steps or saves_per_epoch, or use save_strategy: epoch or no."
    )
    found = problems({**MINIMAL, "eval_strategy": "epoch", "eval_steps": 10, "val_set_size": 0.1})
    assert (
        found["eval_strategy"]
        == "epoch and eval_steps both say when (epoch: at the end of each epoch); keep one of them."
    )
    note = "\n".join(axolotl_notes(validate_recipe({**MINIMAL, "eval_strategy": "epoch"})))
    assert "eval_strategy: epoch is not used: the recipe has no evaluation data" in note
    # without evaluation data the Trainer is told no (it refuses an eval_strategy without an eval_dataset)
    assert args(eval_strategy="epoch").eval_strategy == "no"
    assert args(eval_strategy="steps", evals_per_epoch=2).eval_strategy == "no"
