"""`cptune train` end to end: cp=4 and dp=2×cp=2 (one launch of 4 processes) equal cp=1 through the Trainer."""

from __future__ import annotations

import pytest
import torch

from tests.collective_audit import EVAL_TOTALS, STEP_TARGETS, THROUGHPUT
from tests.conftest import logged, logged_losses, max_rel_diff, run_cptune
from tests.dist_utils import run_ranks
from tests.numerics import logged_tolerance
from tests.run.test_resume import WORKER


@pytest.mark.distributed
def test_cp4_and_dp2xcp2_match_cp1_step_by_step(write_recipe, tmp_path, tiny_model_dir, collective_audit):
    """ring-flash-attn, LoRA with dropout, through the Trainer: losses, gradient norms and eval loss.

    SGD with gradient accumulation 2: SGD's update is linear in the gradient, so a wrong
    gradient scale (an extra division by the accumulation steps, by cp or by dp) changes
    every later loss; the gradient norm the Trainer logs shows it from the first step.
    AdamW would hide it (its update does not change when the gradient is scaled).
    ``lora_dropout: 0.1``: each rank must draw its slice of the masks cp=1 draws.
    """
    common = dict(
        max_steps=5,
        logging_steps=2,
        optimizer="sgd",
        learning_rate=0.05,
        gradient_accumulation_steps=2,
        lora_dropout=0.1,
        val_set_size=5,  # 5 rows over 2 data-parallel groups: one group evaluates a filler row
        eval_steps=5,
    )
    # 5 steps logged every 2: the last step is not a logging step, so the run's train_loss includes
    # a loss that the Trainer does not average over the ranks unless cptune logs the last step.
    recipe = write_recipe(**common)
    cp1 = tmp_path / "cp1"
    done = run_cptune("train", str(recipe), f"--output_dir={cp1}", "--context_parallel_size=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    # cp=4, and dp=2 groups of micro batch 1 (the rows the cp=1 run trains as micro batch 2): both
    # world size 4, so one launch of 4 processes trains them one after the other. `cptune train`'s
    # own launch of 4 processes is run by tests/run/test_train_torch_cp.py and test_deepspeed_e2e.py.
    layouts = {
        "cp4": {"context_parallel_size": 4},
        "dp2xcp2": {"context_parallel_size": 2, "micro_batch_size": 1},
    }
    recipes = [
        write_recipe(f"{name}.yaml", **common, **keys, output_dir=str(tmp_path / name))
        for name, keys in layouts.items()
    ]
    run_ranks(WORKER, 4, tmp_path / "launch", *map(str, recipes))
    logs = {
        name: {key: logged(tmp_path / name, key) for key in ("loss", "grad_norm", "eval_loss", "train_loss")}
        for name in ("cp1", *layouts)
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
    from pathlib import Path

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
