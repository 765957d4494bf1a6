"""`cptune train` end to end: cp=4 and dp=2×cp=2 (one launch of 4 processes) equal cp=1 through the Trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.collective_audit import EVAL_TOTALS, STEP_TARGETS, THROUGHPUT
from tests.conftest import logged, logged_losses, lora_recipe, max_rel_diff
from tests.dist_utils import run_ranks
from tests.numerics import logged_tolerance
from tests.run.one_process import one_process_reference
from tests.run.test_resume import WORKER

# The runs of the test below: SGD with gradient accumulation 2, LoRA with dropout, evaluated at the end.
# 5 steps logged every 2: the last step is not a logging step, so the run's train_loss includes
# a loss that the Trainer does not average over the ranks unless cptune logs the last step.
COMMON = dict(
    max_steps=5,
    logging_steps=2,
    optimizer="sgd",
    learning_rate=0.05,
    gradient_accumulation_steps=2,
    lora_dropout=0.1,
    val_set_size=5,  # 5 rows over 2 data-parallel groups: one group evaluates a filler row
    eval_steps=5,
)


@one_process_reference("e2e", "test_cp4_and_dp2xcp2_match_cp1_step_by_step")
def cp1_reference(folder: Path, tiny_model_dir: Path) -> list[Path]:
    """The cp=1 run of :data:`COMMON`, into ``folder / "cp1"``."""
    keys = {**COMMON, "context_parallel_size": 1, "output_dir": str(folder / "cp1")}
    return [lora_recipe(folder, tiny_model_dir, "cp1.yaml", **keys)]


@pytest.mark.distributed
def test_cp4_and_dp2xcp2_match_cp1_step_by_step(
    write_recipe, tmp_path, tiny_model_dir, collective_audit, one_process_runs
):
    """ring-flash-attn, LoRA with dropout, through the Trainer: losses, gradient norms and eval loss.

    SGD with gradient accumulation 2: SGD's update is linear in the gradient, so a wrong
    gradient scale (an extra division by the accumulation steps, by cp or by dp) changes
    every later loss; the gradient norm the Trainer logs shows it from the first step.
    AdamW would hide it (its update does not change when the gradient is scaled).
    ``lora_dropout: 0.1``: each rank must draw its slice of the masks cp=1 draws.
    The cp=1 run trains in the session's one process of cp=1 references (tests/run/one_process.py).
    """
    references = one_process_runs["e2e"]
    cp1 = references / "cp1"
    # cp=4, and dp=2 groups of micro batch 1 (the rows the cp=1 run trains as micro batch 2): both
    # world size 4, so one launch of 4 processes trains them one after the other. `cptune train`'s
    # own launch of 4 processes is run by tests/run/test_train_torch_cp.py and test_deepspeed_e2e.py.
    layouts = {
        "cp4": {"context_parallel_size": 4},
        "dp2xcp2": {"context_parallel_size": 2, "micro_batch_size": 1},
    }
    recipes = [
        write_recipe(
            f"{name}.yaml",
            **COMMON,
            **keys,
            output_dir=str(tmp_path / name),
            dataset_prepared_path=str(references / "prepared"),  # the data the cp=1 run prepared
        )
        for name, keys in layouts.items()
    ]
    ranks = run_ranks(WORKER, 4, tmp_path / "launch", *map(str, recipes))
    # Every gloo group of the runs (world, data-parallel, CP, the device mesh's) has one worker thread: two
    # write a group's status string together and corrupt the heap (cptune/patches/torch_patches.py).
    threads = [run["gloo_worker_threads"] for rank in ranks for run in rank["runs"]]
    assert all(set(groups) == {1} for groups in threads) and max(map(len, threads)) >= 4, threads
    logs = {
        name: {key: logged(out, key) for key in ("loss", "grad_norm", "eval_loss", "train_loss")}
        for name, out in {"cp1": cp1, **{name: tmp_path / name for name in layouts}}.items()
    }
    expected = logs["cp1"]
    # Logged after steps 1 (the first), 2, 4 and 5 (the last).
    assert sorted(expected["loss"]) == [1, 2, 4, 5] and len(set(expected["loss"].values())) > 1
    for name in ("cp4", "dp2xcp2"):
        diffs = {key: max_rel_diff(logs[name][key], expected[key]) for key in expected}
        print(name, "max rel diff vs cp=1:", diffs)
        # Bound (tests/numerics.py): rows of 128 tokens, 4 a step (2 x accumulation 2), 5 evaluated.
        assert max(diffs.values()) <= logged_tolerance(128, 5), (name, diffs, logs[name], expected)
    collective_audit.check(STEP_TARGETS, THROUGHPUT, EVAL_TOTALS)
    assert_adapter_loads_with_peft(tmp_path / "cp4", tiny_model_dir)


def assert_adapter_loads_with_peft(out, tiny_model_dir) -> None:
    """The adapter a CP run saved loads with plain transformers + peft and is trained."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (out / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("### Instruction:\nhello", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    # The trained adapter is not the zero initialisation.
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().max() > 0 for p in lora_b)


@pytest.mark.distributed
def test_train_reverts_every_patch_after_success_and_failure(write_recipe, tmp_path):
    recipe = write_recipe(max_steps=1, context_parallel_size=2)
    worker = Path(__file__).with_name("revert_worker.py")
    results = run_ranks(worker, 2, tmp_path / "ranks", str(recipe), bitsandbytes=False)
    for r in results:
        assert len(r["targets"]) >= 4
        assert r["same_after_success"] and r["same_after_failure"] and r["raised"], r
        assert r["env_same_after_success"] and r["env_same_after_failure"], r
        assert not r["cp_context_left"], r


@pytest.mark.distributed
def test_runs_directly_under_torchrun(write_recipe, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "torchrun"
    recipe = write_recipe(max_steps=2, context_parallel_size=2, report_to="tensorboard")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "cptune",
            "train",
            str(recipe),
            f"--output_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(logged_losses(out)) == 2
    assert list(out.glob("runs/*/events.out.tfevents.*")), "report_to: tensorboard wrote no event file"
