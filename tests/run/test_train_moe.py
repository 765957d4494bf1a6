"""`cptune train` of a mixture-of-experts model with its router loss on: cp=2 logs what cp=1 logs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import (
    QUICKSTART_DATA,
    in_process_state,
    logged,
    max_rel_diff,
    run_cptune,
    succeeded,
    write_short_run,
)
from tests.numerics import logged_tolerance
from tests.run.one_process import one_process_reference


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
FAMILIES = ("qwen3_moe", "mixtral")


def moe_recipe(root, moe, name: str, **keys):
    """The MoE model for 3 steps (SGD, accumulation 2, the router loss turned on by the recipe's
    ``overrides_of_model_config``), into ``root / name``."""
    router = {"output_router_logits": True, "router_aux_loss_coef": 0.02}
    return write_short_run(root, name, moe, overrides_of_model_config=router, **keys)


def moe_logs(root, name: str) -> dict[str, dict[int, float]]:
    """The loss, gradient norm and router loss of each step of the run in ``root / name``."""
    logs = {key: logged(root / name, key) for key in LOGGED}
    assert sorted(logs["router_aux_loss"]) == [1, 2, 3], logs
    return logs


def train_moe(root, moe, name: str, **keys) -> dict[str, dict[int, float]]:
    """``cptune train`` of :func:`moe_recipe`: the loss, gradient norm and router loss of each step."""
    succeeded(run_cptune("train", str(moe_recipe(root, moe, name, **keys)), timeout=400))
    return moe_logs(root, name)


# The Mixtral test's rows: unpacked, one per micro batch, the chunked head loss on.
MIXTRAL_KEYS = {
    "sample_packing": False,
    "cut_cross_entropy": True,
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 4,
}


@one_process_reference("moe", "cp1_runs")
def cp1_references(folder: Path, tiny_model_dir: Path) -> list[Path]:
    """The tiny Qwen3-MoE and Mixtral (saved into ``folder``) and their cp=1 runs' recipes."""
    models = {family: save_tiny_moe(folder / family, tiny_model_dir, family) for family in FAMILIES}
    return [
        moe_recipe(folder, models["qwen3_moe"], "qwen3_moe-cp1", context_parallel_size=1),
        moe_recipe(folder, models["mixtral"], "mixtral-cp1", context_parallel_size=1, **MIXTRAL_KEYS),
    ]


@pytest.fixture(scope="module")
def cp1_runs(one_process_runs):
    """The cp=1 runs the tests below compare with, of the tiny Qwen3-MoE and of the tiny Mixtral, in the
    session's one process of cp=1 references (tests/run/one_process.py: start-up paid once, not per run).

    Returns (the folder of the runs, family -> model folder, family -> the cp=1 run's logs); the cp=2
    runs go into the same folder, so they read the data the cp=1 runs prepared.
    """
    root = one_process_runs["moe"]
    models = {family: root / family for family in FAMILIES}
    return root, models, {family: moe_logs(root, f"{family}-cp1") for family in FAMILIES}


def assert_logs_match(got: dict, expected: dict) -> None:
    diffs = {key: max_rel_diff(got[key], expected[key]) for key in LOGGED}
    # Bound (tests/numerics.py): rows of 128 tokens, 4 a step (2 x accumulation 2), 640 terms; a micro
    # batch's router sums add 2 rows x 128 tokens x 2 layers = 512 terms of size <= 1, within it.
    assert max(diffs.values()) <= logged_tolerance(128, 4), (diffs, got, expected)


@pytest.mark.distributed
def test_a_moe_models_router_loss_is_trained_and_logged_at_cp2_as_at_cp1(cp1_runs):
    """A tiny Qwen3-MoE, full fine-tune, packed rows: cp=2 with ring-flash-attn and with deepspeed (Ulysses,
    cptune's document attention as its core) log the cp=1 run's loss, gradient norm and ``router_aux_loss``
    at every step. Under Ulysses the MoE layers see this rank's contiguous half of the tokens."""
    root, models, expected = cp1_runs
    for backend in ("ring-flash-attn", "deepspeed"):
        name = f"qwen3_moe-cp2-{backend}"
        got = train_moe(root, models["qwen3_moe"], name, context_parallel_size=2, cp_backend=backend)
        assert_logs_match(got, expected["qwen3_moe"])


@pytest.mark.distributed
def test_a_mixtral_router_loss_with_the_torch_backend_and_the_chunked_loss_is_logged_at_cp2_as_at_cp1(
    cp1_runs, cptune_in_process
):
    """A tiny Mixtral, unpacked rows one per micro batch (torch's CP attention takes no document mask, so padding
    would see real tokens: refused, cptune.parallel.router_padding), the chunked head loss on (``cut_cross_entropy``:
    the model is called for one token of logits, its router logits still come back): cp=2 with cp_backend torch
    (load-balanced head-tail shards) logs the cp=1 run's values. Micro batches of 2 rows are refused by validate."""
    root, models, expected = cp1_runs
    keys = {"context_parallel_size": 2, "cp_backend": "torch", **MIXTRAL_KEYS}
    got = train_moe(root, models["mixtral"], "mixtral-cp2-torch", **keys)
    assert_logs_match(got, expected["mixtral"])
    padded = yaml.safe_load((root / "mixtral-cp2-torch.yaml").read_text()) | {"micro_batch_size": 2}
    (root / "mixtral-padded.yaml").write_text(yaml.safe_dump(padded))
    done = cptune_in_process("validate", str(root / "mixtral-padded.yaml"))  # no process start: a refusal
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "micro_batch_size: 2: the model adds a router load-balancing loss" in done.stderr, done.stderr


def test_preference_training_of_a_moe_model_with_its_router_loss_is_refused(
    tmp_path, tiny_model_dir, cptune_in_process, monkeypatch
):
    """DPO's loss does not include the router loss yet: refused, not silently dropped (in this process: a
    refusal before any weight loads needs no process start of its own)."""
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
    from transformers import AutoModelForCausalLM

    loaded = []  # the model's weights, were they loaded: the refusal must come first

    def load(*args, **kwargs):
        loaded.append(args)
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    before = in_process_state()
    for command in ("validate", "train"):  # refused before any weight loads, by validate as by train
        done = cptune_in_process(command, str(path))
        assert not loaded, (command, done.stderr)
        assert done.returncode != 0
        assert (
            "rl: the model adds a router load-balancing loss (output_router_logits with router_aux_loss_coef 0.02)"
            in (done.stderr)
        ), (command, done.stderr)
        assert "Traceback" not in done.stderr
    # train got as far as setting the allocator's variable and turning the progress bars off (stderr is captured):
    # the fixture puts them back, so that later tests of this pytest process see neither
    assert in_process_state() == before
