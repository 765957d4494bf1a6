"""Checkpoints, resume, saved adapters and merge-lora through real cp=2 runs.

One uninterrupted cp=2 run (LoRA with dropout, packed, grad accumulation 2,
evaluation and a save every 3 steps, save_total_limit 2) is the reference. A
second run is killed with SIGKILL on every rank while checkpoint-6 is being
written, so checkpoint-3 is the newest complete one and a partial checkpoint-6
is left in the staging folder; ``cptune train --resume`` must continue from
checkpoint-3 and log the uninterrupted run's losses. The reference run's saved
adapter, loaded with plain transformers + peft, must give the trained model's
logits, and so must the model that ``cptune merge-lora`` writes; ``cptune
evaluate`` of that adapter at cp=1 must give the eval loss logged at the end of
the cp=2 training.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from cptune.run.launch.processes import LaunchPlan, child_environment, free_port
from cptune.run.training.checkpoints import STAGING_DIR, complete_checkpoints
from tests.collective_audit import EVAL_TOTALS, STEP_TARGETS, THROUGHPUT, auditing
from tests.conftest import QUICKSTART_DATA, run_cptune
from tests.dist_utils import run_ranks
from tests.numerics import assert_float64_twins_rule, logged_tolerance
from tests.parallel.reorder_twins import sdpa_twin_runs

WORKER = Path(__file__).with_name("train_worker.py")
MAX_STEPS, SAVE_STEPS = 7, 3


def recipe_for(root: Path, model_dir: Path, name: str) -> Path:
    recipe = {
        "base_model": str(model_dir),
        "datasets": [{"path": str(QUICKSTART_DATA), "type": "alpaca_instruct.load_no_prompt"}],
        "val_set_size": 8,
        "dataset_prepared_path": str(root / "prepared"),
        "sequence_len": 128,
        "sample_packing": True,
        "adapter": "lora",
        "lora_r": 8,
        "lora_alpha": 16,
        # Dropout draws random numbers every step: the resumed run matches only if the RNG state is restored.
        "lora_dropout": 0.1,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "max_steps": MAX_STEPS,
        "learning_rate": 0.002,
        "warmup_steps": 2,
        "logging_steps": 1,
        "eval_steps": SAVE_STEPS,
        "save_steps": SAVE_STEPS,
        "save_total_limit": 2,
        "context_parallel_size": 2,
        "output_dir": str(root / name),
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_until_killed(
    recipe: Path,
    out_dir: Path,
    world_size: int = 2,
    timeout: float = 240,
    crash_saving_step: int = 2 * SAVE_STEPS,
) -> list[int]:
    """Run the worker with ``--crash-saving-step``; returns every rank's exit code."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port, plan = free_port(), LaunchPlan(nproc_per_node=world_size)
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(out_dir),
                str(recipe),
                "--crash-saving-step",
                str(crash_saving_step),
            ],
            env=child_environment(plan, rank, port, base),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(world_size)
    ]
    return [p.wait(timeout=timeout) for p in procs]


def step_logs(out_dir: Path, key: str) -> dict[int, float]:
    history = json.loads((out_dir / "train_log.json").read_text())
    return {entry["step"]: entry[key] for entry in history if key in entry}


def adapter_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_model_dir) -> Path:
    """The uninterrupted cp=2 run; its folder holds the adapter and the trained model's logits."""
    root = tmp_path_factory.mktemp("resume")
    recipe = recipe_for(root, tiny_model_dir, "reference")
    with auditing(root / "collectives") as audit:
        run_ranks(WORKER, 2, root / "reference", str(recipe))
    audit.check(STEP_TARGETS, THROUGHPUT, EVAL_TOTALS)
    return root / "reference"


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_after_sigkill_during_save_equals_the_uninterrupted_run(reference_run, tiny_model_dir):
    root = reference_run.parent
    recipe = recipe_for(root, tiny_model_dir, "interrupted")
    out = root / "interrupted"
    with auditing(root / "collectives-resumed") as audit:
        codes = run_until_killed(recipe, out)
        assert codes == [-9, -9], codes
        # The save of step 6 died half-way: its files are staged, never published.
        assert [step for step, _ in complete_checkpoints(out)] == [SAVE_STEPS]
        assert (out / STAGING_DIR / f"checkpoint-{2 * SAVE_STEPS}" / "adapter_model.safetensors").is_file()
        assert not (out / f"checkpoint-{2 * SAVE_STEPS}").exists()
        done = run_cptune("train", str(recipe), "--resume")
    # The runs that wrote the checkpoints and resumed from one call cptune's collectives through the helper.
    audit.check(STEP_TARGETS, THROUGHPUT, EVAL_TOTALS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from {out / f'checkpoint-{SAVE_STEPS}'}" in done.stderr
    expected, resumed = step_logs(reference_run, "loss"), step_logs(out, "loss")
    assert sorted(resumed) == sorted(expected) == list(range(1, MAX_STEPS + 1))
    after = [step for step in expected if step > SAVE_STEPS]
    diffs = {step: abs(resumed[step] - expected[step]) / abs(expected[step]) for step in after}
    print("resume: per-step loss rel diffs after the resume point", diffs)
    # Exact: the resumed run repeats the uninterrupted run's operations, in the same layout on the
    # same machine, from a state restored bit for bit (weights, optimizer, RNG, data position).
    assert max(diffs.values()) == 0, (resumed, expected)
    assert step_logs(out, "eval_loss") == step_logs(reference_run, "eval_loss")
    # The resumed run's final adapter is the uninterrupted run's; save_total_limit kept the newest 2.
    ref, got = adapter_weights(reference_run), adapter_weights(out)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert [step for step, _ in complete_checkpoints(out)] == [2 * SAVE_STEPS, MAX_STEPS]
    assert not (out / STAGING_DIR).exists(), "the partial save must be cleared by the next save"


@pytest.mark.distributed
@pytest.mark.slow
def test_saved_adapter_and_merged_model_give_the_trained_models_logits(
    reference_run, tiny_model_dir, cptune_in_process
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.run.train_worker import FIXED_TEXT, fixed_input_ids

    trained = torch.load(reference_run / "logits.pt")
    tokenizer = AutoTokenizer.from_pretrained(reference_run)
    ids = fixed_input_ids(tokenizer)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, reference_run).eval()
    with torch.no_grad():
        loaded = with_adapter(input_ids=ids).logits
        loaded64 = copy.deepcopy(with_adapter).double()(input_ids=ids).logits
        twins = sdpa_twin_runs(with_adapter, lambda: {"logits": with_adapter(input_ids=ids).logits})
    adapter_diff = float((loaded - trained).abs().max())

    # In this process: the merge needs no process start of its own (the launch is the reference run's).
    done = cptune_in_process("merge-lora", str(reference_run.parent / "reference.yaml"))
    assert done.returncode == 0, done.stderr[-3000:]
    merged_dir = reference_run / "merged"
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
    merged_diff = float((merged_logits - loaded).abs().max())
    print(
        f"logits max abs diff: saved adapter vs trained {adapter_diff:.3g}, merged vs adapter {merged_diff:.3g}"
    )
    # Twins rule (tests/numerics.py): the cp=2 model's logits and the merged model's (merging changes the order
    # of the additions) within 32x of the farthest distance of the saved adapter's fp32 logits and their 2 twins
    # (sdpa's math backend, sdpa over the tokens in a strided order: tests/parallel/reorder_twins.py).
    for got in (trained, merged_logits):
        assert_float64_twins_rule({"logits": got}, [{"logits": loaded}, *twins], {"logits": loaded64})
    with torch.no_grad(), with_adapter.disable_adapter():
        untrained = with_adapter(input_ids=ids).logits
    assert float((trained - untrained).abs().max()) > 1e-3, "training changed nothing"
    assert AutoTokenizer.from_pretrained(merged_dir)(FIXED_TEXT).input_ids == ids[0].tolist()


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_during_cp2_training_equals_cptune_evaluate_of_the_saved_adapter(reference_run):
    logged = step_logs(reference_run, "eval_loss")
    assert sorted(logged) == [SAVE_STEPS, 2 * SAVE_STEPS, MAX_STEPS]  # every eval_steps, and at the end
    done = run_cptune(
        "evaluate",
        str(reference_run.parent / "reference.yaml"),
        "--checkpoint",
        str(reference_run),
        "--context_parallel_size=1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads(done.stdout.strip().splitlines()[-1])
    print("eval during cp=2 training vs cptune evaluate at cp=1:", logged[MAX_STEPS], metrics["eval_loss"])
    # Bound (tests/numerics.py): cp=2 and one process add the 8 held-out rows of 128 tokens in other orders.
    assert metrics["eval_loss"] == pytest.approx(logged[MAX_STEPS], rel=logged_tolerance(128, 8))
