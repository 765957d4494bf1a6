"""`cptune train` of a mixture-of-experts model with its router loss on: cp=2 logs what cp=1 logs."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import QUICKSTART_DATA, logged, max_rel_diff, run_cptune, succeeded
from tests.numerics import logged_tolerance


def save_tiny_moe(folder, tiny_model_dir):
    """A tiny Qwen3-MoE with the tiny Llama's tokenizer (router loss off in its config.json)."""
    from transformers import AutoTokenizer

    from devtools.tiny import build_tiny_qwen3_moe

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = build_tiny_qwen3_moe(
        len(tokenizer),
        seed=1,
        output_router_logits=False,  # the recipe turns it on
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.distributed
def test_a_moe_models_router_loss_is_trained_and_logged_at_cp2_as_at_cp1(tmp_path, tiny_model_dir):
    """A tiny Qwen3-MoE, full fine-tune, SGD with accumulation 2, the router loss turned on by the recipe
    (``overrides_of_model_config``): the loss, gradient norm and ``router_aux_loss`` of every step."""
    moe = save_tiny_moe(tmp_path / "moe", tiny_model_dir)
    logs = {}
    for cp in (1, 2):
        recipe = {
            "base_model": str(moe),
            "datasets": [{"path": str(QUICKSTART_DATA), "type": "alpaca"}],
            "dataset_prepared_path": str(tmp_path / "prepared"),
            "sequence_len": 128,
            "sample_packing": True,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "max_steps": 3,
            "optimizer": "sgd",
            "learning_rate": 0.05,
            "logging_steps": 1,
            "output_dir": str(tmp_path / f"cp{cp}"),
            "overrides_of_model_config": {"output_router_logits": True, "router_aux_loss_coef": 0.02},
            "context_parallel_size": cp,
        }
        path = tmp_path / f"cp{cp}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        succeeded(run_cptune("train", str(path)))
        logs[cp] = {
            key: logged(tmp_path / f"cp{cp}", key) for key in ("loss", "grad_norm", "router_aux_loss")
        }
    assert sorted(logs[1]["router_aux_loss"]) == [1, 2, 3]
    diffs = {key: max_rel_diff(logs[2][key], logs[1][key]) for key in logs[1]}
    # Bound (tests/numerics.py): rows of 128 tokens, 4 a step (2 x accumulation 2), 640 terms; a micro
    # batch's router sums add 2 rows x 128 tokens x 2 layers = 512 terms of size <= 1, within it.
    assert max(diffs.values()) <= logged_tolerance(128, 4), (diffs, logs)


@pytest.mark.distributed
def test_preference_training_of_a_moe_model_with_its_router_loss_is_refused(tmp_path, tiny_model_dir):
    """DPO's loss does not include the router loss yet: refused, not silently dropped."""
    recipe = {
        "base_model": str(save_tiny_moe(tmp_path / "moe", tiny_model_dir)),
        "datasets": [
            {
                "path": str(QUICKSTART_DATA.with_name("preference.jsonl")),
                "type": "chat_template.default",
                "field_messages": "prompt",
                "field_chosen": "chosen",
                "field_rejected": "rejected",
            }
        ],
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "sequence_len": 256,
        "sample_packing": True,
        "rl": "dpo",
        "adapter": "lora",
        "lora_target_linear": True,
        "micro_batch_size": 1,
        "max_steps": 1,
        "output_dir": str(tmp_path / "out"),
        "overrides_of_model_config": {"output_router_logits": True, "router_aux_loss_coef": 0.02},
    }
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    for command in ("validate", "train"):  # refused before any weight loads, by validate as by train
        done = run_cptune(command, str(path))
        assert done.returncode != 0
        assert (
            "rl: the model adds a router load-balancing loss (output_router_logits with router_aux_loss_coef 0.02)"
            in (done.stderr)
        ), (command, done.stderr)
        assert "Traceback" not in done.stderr
        assert "Loading weights" not in done.stderr
