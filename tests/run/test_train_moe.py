"""`cptune train` of a mixture-of-experts model with its router loss on: cp=2 logs what cp=1 logs."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import QUICKSTART_DATA, logged, max_rel_diff, run_cptune, succeeded, write_short_run
from tests.numerics import logged_tolerance


def save_tiny_moe(folder, tiny_model_dir, family: str = "qwen3_moe"):
    """A tiny Qwen3-MoE (or Mixtral) with the tiny Llama's tokenizer (router loss off in its config.json)."""
    from transformers import AutoTokenizer

    from devtools.tiny import build_tiny_mixtral, build_tiny_qwen3_moe

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    build = {"qwen3_moe": build_tiny_qwen3_moe, "mixtral": build_tiny_mixtral}[family]
    model = build(
        len(tokenizer),
        seed=1,
        output_router_logits=False,  # the recipe turns it on
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


LOGGED = ("loss", "grad_norm", "router_aux_loss")


def train_moe(tmp_path, moe, name: str, **keys) -> dict[str, dict[int, float]]:
    """``cptune train`` of the MoE model for 3 steps (SGD, accumulation 2, the router loss turned on by
    the recipe's ``overrides_of_model_config``): the loss, gradient norm and router loss of each step."""
    router = {"output_router_logits": True, "router_aux_loss_coef": 0.02}
    path = write_short_run(tmp_path, name, moe, overrides_of_model_config=router, **keys)
    succeeded(run_cptune("train", str(path), timeout=400))
    logs = {key: logged(tmp_path / name, key) for key in LOGGED}
    assert sorted(logs["router_aux_loss"]) == [1, 2, 3], logs
    return logs


def assert_logs_match(got: dict, expected: dict) -> None:
    diffs = {key: max_rel_diff(got[key], expected[key]) for key in LOGGED}
    # Bound (tests/numerics.py): rows of 128 tokens, 4 a step (2 x accumulation 2), 640 terms; a micro
    # batch's router sums add 2 rows x 128 tokens x 2 layers = 512 terms of size <= 1, within it.
    assert max(diffs.values()) <= logged_tolerance(128, 4), (diffs, got, expected)


@pytest.mark.distributed
def test_a_moe_models_router_loss_is_trained_and_logged_at_cp2_as_at_cp1(tmp_path, tiny_model_dir):
    """A tiny Qwen3-MoE, full fine-tune, packed rows: cp=2 with ring-flash-attn and with deepspeed (Ulysses,
    cptune's document attention as its core) log the cp=1 run's loss, gradient norm and ``router_aux_loss``
    at every step. Under Ulysses the MoE layers see this rank's contiguous half of the tokens."""
    moe = save_tiny_moe(tmp_path / "moe", tiny_model_dir)
    expected = train_moe(tmp_path, moe, "cp1", context_parallel_size=1)
    for backend in ("ring-flash-attn", "deepspeed"):
        got = train_moe(tmp_path, moe, f"cp2-{backend}", context_parallel_size=2, cp_backend=backend)
        assert_logs_match(got, expected)


@pytest.mark.distributed
def test_a_mixtral_router_loss_with_the_torch_backend_and_the_chunked_loss_is_logged_at_cp2_as_at_cp1(
    tmp_path, tiny_model_dir
):
    """A tiny Mixtral, unpacked rows one per micro batch (torch's CP attention takes no document mask, so padding
    would see real tokens: refused, cptune.parallel.router_padding), the chunked head loss on (``cut_cross_entropy``:
    the model is called for one token of logits, its router logits still come back): cp=2 with cp_backend torch
    (load-balanced head-tail shards) logs the cp=1 run's values. Micro batches of 2 rows are refused by validate."""
    moe = save_tiny_moe(tmp_path / "mixtral", tiny_model_dir, family="mixtral")
    keys = {
        "sample_packing": False,
        "cut_cross_entropy": True,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 4,
    }
    expected = train_moe(tmp_path, moe, "cp1", context_parallel_size=1, **keys)
    got = train_moe(tmp_path, moe, "cp2-torch", context_parallel_size=2, cp_backend="torch", **keys)
    assert_logs_match(got, expected)
    padded = yaml.safe_load((tmp_path / "cp2-torch.yaml").read_text()) | {"micro_batch_size": 2}
    (tmp_path / "padded.yaml").write_text(yaml.safe_dump(padded))
    done = run_cptune("validate", str(tmp_path / "padded.yaml"))
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "micro_batch_size: 2: the model adds a router load-balancing loss" in done.stderr, done.stderr


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
