"""The stored reference sums of precompute_ref_log_probs (cptune.run.training.reference_cache): what their key holds,
and a file read back gives the written numbers or nothing.

The end-to-end check (a resumed run reads the sums its first run stored and repeats its steps; a sharded run
stores them, a cp=1 run's file is read by no other layout's run there) is in tests/run/test_train_preference.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from cptune.config.loader import load_recipe
from cptune.run.training.reference_cache import FOLDER, ReferenceKey, ReferenceStore

FINGERPRINT = "f" * 64
# float64 values that a float32 or a short decimal form would change
SUMS = [[-12.345678901234567, -0.1000000000000001], [], [-3.0e-300, -7.25, -1.0 / 3.0, -2.0 / 3.0]]


@pytest.fixture
def dpo_recipe(write_recipe):
    """A DPO recipe on the tiny model; keyword arguments override keys."""
    data = {"path": "unused.jsonl", "type": "chat_template.default", "field_messages": "prompt"}

    def recipe(**keys):
        keys = {"rl": "dpo", "datasets": [data], "precompute_ref_log_probs": True, **keys}
        return load_recipe(write_recipe(**keys))

    return recipe


def digest(recipe, fingerprint=FINGERPRINT, split="train") -> str:
    return ReferenceKey.for_recipe(recipe, fingerprint, split).digest


def test_the_key_changes_with_what_changes_the_sums_and_not_with_the_layout(
    dpo_recipe, tiny_model_dir, tmp_path
):
    base = dpo_recipe()
    assert digest(dpo_recipe()) == digest(base)
    # The same sums under any CP backend, CP and data-parallel layout and batch: one file serves them all.
    for layout in (
        {"context_parallel_size": 2, "cp_backend": "torch", "sample_packing": False},
        {"context_parallel_size": 2, "micro_batch_size": 1, "gradient_accumulation_steps": 2},
        {"adapter": None, "fsdp_version": 2, "dp_shard_size": 2, "context_parallel_size": 2},
        {"rl": "ipo", "rl_beta": 0.5, "learning_rate": 1.0},  # the loss reads the sums; it does not make them
    ):
        assert digest(dpo_recipe(**layout)) == digest(base), layout
    changed = {
        "dtype": dpo_recipe(bf16=True),
        "model config": dpo_recipe(overrides_of_model_config={"rms_norm_eps": 1e-3}),
        "revision": dpo_recipe(model_revision="v2"),
    }
    copy = tmp_path / "copy-of-tiny"
    shutil.copytree(tiny_model_dir, copy)
    changed["another model folder"] = dpo_recipe(base_model=str(copy))
    for what, recipe in changed.items():
        assert digest(recipe) != digest(base), what
    assert digest(base, fingerprint="e" * 64) != digest(base)
    assert digest(base, split="eval") != digest(base)


def test_the_key_sees_a_weight_file_rewritten_in_place(dpo_recipe, tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    recipe = dpo_recipe(base_model=str(model))
    before = digest(recipe)
    weights = next(model.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a new save, same size
    assert digest(recipe) != before


@pytest.fixture
def store(dpo_recipe, tmp_path) -> ReferenceStore:
    folder = tmp_path / "prepared" / FINGERPRINT
    folder.mkdir(parents=True)
    return ReferenceStore.for_recipe(dpo_recipe(), folder)


def pair_counts(sums) -> list[int]:
    return [len(row) // 2 for row in sums]


def test_stored_sums_read_back_bit_for_bit_for_the_same_key_and_rows(store):
    assert store.load("train", pair_counts(SUMS)) is None  # nothing stored yet
    path = store.save("train", SUMS)
    assert path.parent == store.data_folder / FOLDER and path.name.startswith("train-")
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no staging file left
    assert store.load("train", pair_counts(SUMS)) == SUMS
    assert store.load("eval", pair_counts(SUMS)) is None  # the other split has its own key


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncate", "unreadable"),
        ("flip a value", "do not match their checksum"),
        ("other key", "written for another key"),
        ("other rows", "written for other rows"),
    ],
)
def test_a_damaged_or_foreign_file_is_not_used_and_says_why(store, caplog, damage, reason):
    path = store.save("train", SUMS)
    counts = pair_counts(SUMS)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-9])
    elif damage == "flip a value":
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40  # inside the last float64 of the sums, the last tensor written
        path.write_bytes(bytes(data))
    elif damage == "other key":
        other = ReferenceStore(store.data_folder, {"train": store.keys["eval"]})
        shutil.copyfile(other.save("train", SUMS), path)
    else:
        counts = [1, 1, 1]
    with caplog.at_level(logging.WARNING, logger="cptune.preference"):
        assert store.load("train", counts) is None
    assert reason in caplog.text and str(path) in caplog.text
    # The pass then runs again and its sums replace the file.
    store.save("train", SUMS)
    assert store.load("train", pair_counts(SUMS)) == SUMS


def test_a_store_lives_inside_the_prepared_datas_folder(store):
    assert store.path("eval") == Path(
        store.data_folder, FOLDER, f"eval-{store.keys['eval'].digest}.safetensors"
    )
    assert store.keys["train"].data_fingerprint == FINGERPRINT


@pytest.mark.slow
def test_evaluate_reads_a_full_fine_tunes_stored_reference_and_a_lora_evaluation_passes_over_eval_rows_only(
    cptune_in_process, tmp_path, monkeypatch, caplog
):
    """In one process, cp=1: a full fine-tune's run stores its first pass's sums; ``cptune evaluate`` of the saved
    model reads the evaluation rows' (no pass over the fine-tuned weights, which are not the reference) and reports
    the run's own last evaluation; without them it refuses. ``cptune evaluate`` of a LoRA adapter runs its first
    pass over the evaluation rows only."""
    from cptune.run.training import preference_trainer
    from tests.conftest import REPO, logged
    from tests.run.test_evaluate import write_adapter

    passes: list[int] = []  # the rows of every first pass, in order
    first_pass = preference_trainer.precompute_reference

    def counted(rows, *args, **kwargs):
        passes.append(len(rows))
        return first_pass(rows, *args, **kwargs)

    monkeypatch.setattr(preference_trainer, "precompute_reference", counted)
    monkeypatch.chdir(REPO)
    out, prepared = tmp_path / "full", tmp_path / "prepared"
    common = ["--context_parallel_size=1", "--val_set_size=4", f"--dataset_prepared_path={prepared}"]
    full = ["--adapter=null", "--precompute_ref_log_probs=true", *common]
    done = cptune_in_process(
        "train", "examples/cpu/dpo.yaml", *full, "--max_steps=2", "--eval_steps=2", f"--output_dir={out}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(passes) == 2 and "reference sums stored in" in caplog.text, (passes, caplog.text[-3000:])
    training_rows, evaluation_rows = passes

    caplog.clear()
    done = cptune_in_process("evaluate", "examples/cpu/dpo.yaml", *full, "--checkpoint", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(passes) == 2 and "evaluation rows read from" in caplog.text, (passes, caplog.text[-3000:])
    metrics = json.loads(done.stdout.strip().splitlines()[-1])
    # The saved model is the run's after step 2, evaluated there on the same rows against the same sums, in the
    # same batches: the same numbers, exactly.
    assert metrics["eval_loss"] == logged(out, "eval_loss")[2] and metrics["eval_loss"] > 0, metrics
    assert metrics["eval_rewards/margins"] == logged(out, "eval_rewards/margins")[2], metrics

    (stored,) = prepared.glob(f"*/{FOLDER}")
    shutil.rmtree(stored)
    done = cptune_in_process("evaluate", "examples/cpu/dpo.yaml", *full, "--checkpoint", str(out))
    assert done.returncode != 0 and "none matches this recipe's data and base model" in done.stderr, (
        done.stderr
    )
    assert len(passes) == 2  # nothing computed from the fine-tuned weights

    adapter = write_adapter(tmp_path / "adapter")
    done = cptune_in_process(
        "evaluate",
        "examples/cpu/dpo.yaml",
        "--precompute_ref_log_probs=true",
        *common,
        "--checkpoint",
        str(adapter),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert passes[2:] == [evaluation_rows] and training_rows != evaluation_rows, passes


def test_the_key_sees_quantized_experts(dpo_recipe):
    """With quantize_moe_experts the reference model's experts hold their 4-bit values: other sums."""
    qlora = {"adapter": "qlora", "load_in_4bit": True, "gradient_checkpointing": True}
    assert digest(dpo_recipe(**qlora, quantize_moe_experts=True)) != digest(dpo_recipe(**qlora))
    # Off is the key written before the switch existed.
    assert digest(dpo_recipe(**qlora, quantize_moe_experts=False)) == digest(dpo_recipe(**qlora))
