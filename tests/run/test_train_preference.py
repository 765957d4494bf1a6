"""`cptune train` of a full-fine-tune DPO recipe with precompute_ref_log_probs: dp_shard=2 × cp=2 with the model
states sharded by FSDP2, and dp=2 × cp=2 under ZeRO-3, log cp=1's numbers, their evaluations too, and a resumed
sharded run repeats its steps. (cp=2 alone, without sharding, is checked pair by pair in
tests/parallel/test_parity.py and through the CLI by tests/test_examples.py's DPO example.)

The first pass (cptune.run.training.reference_pass) splits the training rows over the data-parallel
groups and each row over its CP group; with sharded parameters it runs on the prepared model, every rank
in each forward (each gathers the parameters from all 4 ranks). The logged loss, gradient norm and DPO
metrics of every step must equal the cp=1 run's. The first step's policy is the reference: loss ln 2,
margin 0 exactly. Four pairs are held out (val_set_size) and evaluated every 2 steps: their reference sums
come from the same first pass, and eval_loss and the eval_ metrics (means over the held-out pairs) must equal
the cp=1 run's too; with two data-parallel groups the second evaluates a filler row, whose pairs count
nowhere. The pair-level parity of the same code (float64 reference) is in tests/parallel/test_parity.py.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml

from cptune.config.loader import parse_override
from tests.conftest import REPO, logged, max_rel_diff, run_cptune, shipped_example
from tests.numerics import logged_tolerance
from tests.run.one_process import one_process_reference

BETA = 0.1  # examples/cpu/dpo.yaml's rl_beta
KEYS = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected")
EVAL_KEYS = (
    "eval_loss",
    "eval_logps/chosen",
    "eval_logps/rejected",
    "eval_rewards/chosen",
    "eval_rewards/rejected",
)
HELD_OUT = 4  # val_set_size: pairs
SHARDED_PASS = re.compile(r"the first pass over \d+ training rows runs on the sharded model")
STORED_SUMS_READ = re.compile(
    r"the reference sums of \d+ (training|evaluation) rows read from .*reference_log_probs"
)


DPO_EXAMPLE = REPO / "examples" / "cpu" / "dpo.yaml"
# The runs of the test below, on top of the example.
COMMON = [
    "--adapter=null",
    "--precompute_ref_log_probs=true",
    "--optimizer=sgd",  # a wrong gradient scale shows as it is
    "--learning_rate=0.05",
    "--warmup_steps=0",
    "--max_steps=4",
    f"--val_set_size={HELD_OUT}",
    "--eval_steps=2",
]
# The cp=1 run's first pass, on the model as loaded (a line of its own in the log).
UNSHARDED_PASS = re.compile(r"the first pass over \d+ training rows runs$", re.MULTILINE)
DPO_TEST = "test_full_fine_tune_dpo_with_precomputed_reference_fsdp2_zero3_and_resume_log_cp1s_numbers"


@one_process_reference("dpo-precomputed", DPO_TEST)
def cp1_reference(folder: Path, tiny_model_dir: Path) -> list[Path]:
    """The example with :data:`COMMON` at cp=1, micro batch 2, as ``cptune train`` reads those flags, into
    ``folder / "cp1"``; its data prepared in a folder of its own, so it runs its first pass."""
    keys = {
        **shipped_example(DPO_EXAMPLE, folder, "cp1"),
        **dict(map(parse_override, [*COMMON, "--context_parallel_size=1", "--micro_batch_size=2"])),
    }
    recipe = folder / "cp1.yaml"
    recipe.write_text(yaml.safe_dump(keys))
    return [recipe]


@pytest.mark.distributed
def test_full_fine_tune_dpo_with_precomputed_reference_fsdp2_zero3_and_resume_log_cp1s_numbers(
    tmp_path, one_process_runs
):
    # The cp=1 run trains in the session's one process of cp=1 references (tests/run/one_process.py); its log is
    # its own part of that launch's log, so the first pass found there is its own, on the model as loaded.
    references = one_process_runs["dpo-precomputed"]
    reference_log = one_process_runs.log("dpo-precomputed")
    assert UNSHARDED_PASS.search(reference_log), reference_log[-3000:]
    assert not SHARDED_PASS.search(reference_log), reference_log[-3000:]
    # ZeRO-3 keeps parameters below stage3_param_persistence_threshold (1e5 elements by default, so all of
    # the tiny model's) whole on every rank; 0 partitions them all, as a real model's are.
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    runs = {
        # Two data-parallel groups of one row each train the rows cp=1 trains as micro batches of 2, every
        # weight split over the 4 ranks.
        "fsdp2": ["--fsdp_version=2", "--dp_shard_size=2", "--micro_batch_size=1", "--save_steps=2"],
        "zero3": [f"--deepspeed={zero3}", "--micro_batch_size=1", "--nproc-per-node", "4"],
    }
    logs = {"cp1": dpo_logs(references / "cp1")}
    for name, extra in runs.items():
        out = tmp_path / name
        # Each run its own prepared data, so each runs its first pass (no other run's stored sums).
        extra = [*extra, f"--dataset_prepared_path={tmp_path / 'prepared' / name}"]
        runs[name] = extra
        # 4 processes on a CI machine of 2 cores: DeepSpeed alone takes about a minute to start.
        done = run_cptune(
            "train", "examples/cpu/dpo.yaml", f"--output_dir={out}", *COMMON, *extra, cwd=REPO, timeout=900
        )
        assert done.returncode == 0, done.stderr[-3000:]
        # With the parameters sharded the pass waits for the prepared model (all 4 ranks in each forward).
        assert SHARDED_PASS.search(done.stderr), (name, done.stderr[-3000:])
        logs[name] = dpo_logs(out)
    cp1 = logs["cp1"]
    assert len(cp1["loss"]) == 4 and len(set(cp1["loss"].values())) > 1
    # Evaluated after steps 2 and 4, every held-out pair once; by step 2 the policy has left the reference.
    assert cp1["eval_pairs"] == {2: HELD_OUT, 4: HELD_OUT} and cp1["eval_rewards/chosen"][2] != 0.0, cp1
    # Step 1 trains against the model it started from: policy = reference, exactly.
    assert cp1["rewards/margins"][1] == 0.0 and abs(cp1["loss"][1] - math.log(2)) < 1e-6, cp1
    for name in ("fsdp2", "zero3"):
        assert logs[name]["eval_pairs"] == cp1["eval_pairs"], (name, logs[name])
        assert_logs_cp1s_numbers(name, logs[name], cp1)

    # Resumed from its step-2 checkpoint, the FSDP2 run reads the reference sums its first run stored with the
    # prepared data (the weights as loaded, before any step) instead of running the first pass again (the
    # Trainer prepares the sharded model, then the checkpoint loads), so steps 3 and 4 repeat the finished run's
    # exactly. (The stored file's key and bytes: tests/run/test_reference_cache.py.)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp2", resumed)
    shutil.rmtree(resumed / "checkpoint-4")
    done = run_cptune(
        "train",
        "examples/cpu/dpo.yaml",
        "--resume",
        f"--output_dir={resumed}",
        *COMMON,
        *runs["fsdp2"],
        cwd=REPO,
        timeout=900,
    )
    assert done.returncode == 0 and "resuming from" in done.stderr, done.stderr[-3000:]
    assert "first pass over" not in done.stderr, done.stderr[-3000:]
    assert set(STORED_SUMS_READ.findall(done.stderr)) == {"training", "evaluation"}, done.stderr[-3000:]
    finished = logs["fsdp2"]
    for key in (*KEYS, "rewards/margins", *EVAL_KEYS):
        again = logged(resumed, key)
        steps = [s for s in (3, 4) if s in finished[key]]  # the evaluation logs at step 4 only
        assert {s: again[s] for s in steps} == {s: finished[key][s] for s in steps}, (
            key,
            again,
            finished[key],
        )


def dpo_logs(output_dir) -> dict[str, dict[int, float]]:
    """The DPO numbers a run logged, ``{key: {step: value}}``."""
    return {key: logged(output_dir, key) for key in (*KEYS, "rewards/margins", *EVAL_KEYS, "eval_pairs")}


def assert_logs_cp1s_numbers(name: str, got: dict, cp1: dict) -> None:
    """``got`` (:func:`dpo_logs` of a run of the example's rows) logs the cp=1 run's numbers at every step, and its
    evaluations' where the runs evaluated."""
    assert got["rewards/margins"][1] == 0.0, (name, got)
    keys = (*KEYS, *EVAL_KEYS) if cp1["eval_loss"] else KEYS  # a run without evaluation data logs none
    diffs = {key: max_rel_diff(got[key], cp1[key]) for key in keys if "rewards/" not in key}
    # A reward is β times a difference of two log-prob sums (policy minus reference), 0 at step 1: its error
    # is relative to the sums, not to itself.
    for key in (k for k in keys if "rewards/" in k):
        sums = key.replace("rewards", "logps")
        diffs[key] = max(
            abs(got[key][step] - value) / (BETA * abs(cp1[sums][step])) for step, value in cp1[key].items()
        )
    print(f"{name} max rel diff vs cp=1:", diffs)
    # Bound (tests/numerics.py): rows of at most 512 tokens, 4 rows a step (2 x accumulation 2); the
    # evaluation sums over its 4 pairs, in at most 4 rows.
    assert max(diffs.values()) <= logged_tolerance(512, 4), (name, diffs, got, cp1)
