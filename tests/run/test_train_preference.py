"""`cptune train` of a full-fine-tune DPO recipe with precompute_ref_log_probs: cp=2 and dp=2 log cp=1's numbers,
their evaluations too, and a resumed run repeats the finished run's steps.

The first pass (cptune.run.training.reference_pass) splits the training rows over the data-parallel
groups and each row over its CP group; the logged loss, gradient norm and DPO metrics of every step
must equal the cp=1 run's. The first step's policy is the reference: loss ln 2, margin 0 exactly.
Four pairs are held out (val_set_size) and evaluated every 2 steps: their reference sums come from
the same first pass, and eval_loss and the eval_ metrics (means over the held-out pairs) must equal
the cp=1 run's too; at dp=2 the second group evaluates a filler row, whose pairs count nowhere.
The pair-level parity of the same code (float64 reference) is in tests/parallel/test_parity.py.
"""

from __future__ import annotations

import math
import shutil

import pytest

from tests.conftest import REPO, logged, max_rel_diff, run_cptune
from tests.numerics import logged_tolerance

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


def rel_diffs(run: dict, cp1: dict, keys: tuple[str, ...]) -> dict[str, float]:
    """Each key's largest relative difference from cp=1 over the logged steps.

    A reward is β times a difference of two log-prob sums (policy minus reference), 0 at step 1: its error
    is relative to the sums, not to itself.
    """
    diffs = {}
    for key in keys:
        if "rewards/" not in key:
            diffs[key] = max_rel_diff(run[key], cp1[key])
            continue
        sums = key.replace("rewards", "logps")
        diffs[key] = max(
            abs(run[key][step] - value) / (BETA * abs(cp1[sums][step])) for step, value in cp1[key].items()
        )
    return diffs


@pytest.mark.distributed
def test_full_fine_tune_dpo_with_precomputed_reference_cp2_dp2_and_resume_log_cp1s_numbers(tmp_path):
    common = [
        "--adapter=null",
        "--precompute_ref_log_probs=true",
        "--optimizer=sgd",  # a wrong gradient scale shows as it is
        "--learning_rate=0.05",
        "--warmup_steps=0",
        "--max_steps=4",
        f"--val_set_size={HELD_OUT}",
        "--eval_steps=2",
        f"--dataset_prepared_path={tmp_path / 'prepared'}",
    ]
    runs = {
        "cp1": ["--context_parallel_size=1", "--micro_batch_size=2", "--save_steps=2"],
        "cp2": ["--context_parallel_size=2", "--micro_batch_size=2"],
        # Two data-parallel groups of one row each train the rows cp=1 trains as micro batches of 2.
        "dp2": ["--context_parallel_size=1", "--micro_batch_size=1", "--nproc-per-node", "2"],
    }
    logs = {}
    for name, extra in runs.items():
        out = tmp_path / name
        done = run_cptune("train", "examples/cpu/dpo.yaml", f"--output_dir={out}", *common, *extra, cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        logs[name] = {key: logged(out, key) for key in (*KEYS, "rewards/margins", *EVAL_KEYS, "eval_pairs")}
    cp1 = logs["cp1"]
    assert len(cp1["loss"]) == 4 and len(set(cp1["loss"].values())) > 1
    # Evaluated after steps 2 and 4, every held-out pair once; by step 2 the policy has left the reference.
    assert cp1["eval_pairs"] == {2: HELD_OUT, 4: HELD_OUT} and cp1["eval_rewards/chosen"][2] != 0.0, cp1
    # Step 1 trains against the model it started from: policy = reference, exactly.
    assert cp1["rewards/margins"][1] == 0.0 and abs(cp1["loss"][1] - math.log(2)) < 1e-6, cp1
    for name in ("cp2", "dp2"):
        assert logs[name]["rewards/margins"][1] == 0.0, (name, logs[name])
        assert logs[name]["eval_pairs"] == cp1["eval_pairs"], (name, logs[name])
        diffs = rel_diffs(logs[name], cp1, (*KEYS, *EVAL_KEYS))
        print(f"{name} max rel diff vs cp=1:", diffs)
        # Bound (tests/numerics.py): rows of at most 512 tokens, 4 rows a step (2 x accumulation 2); the
        # evaluation sums over its 4 pairs, in at most 4 rows.
        assert max(diffs.values()) <= logged_tolerance(512, 4), (name, diffs, logs[name], cp1)

    # Resumed from its step-2 checkpoint, the cp=1 run's first pass again computes the reference from the
    # weights as loaded (before the checkpoint is), so steps 3 and 4 repeat the finished run's exactly.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "cp1", resumed)
    shutil.rmtree(resumed / "checkpoint-4")
    done = run_cptune(
        "train",
        "examples/cpu/dpo.yaml",
        "--resume",
        f"--output_dir={resumed}",
        *common,
        *runs["cp1"],
        cwd=REPO,
    )
    assert done.returncode == 0 and "resuming from" in done.stderr, done.stderr[-3000:]
    for key in (*KEYS, "rewards/margins", *EVAL_KEYS):
        again = logged(resumed, key)
        steps = [s for s in (3, 4) if s in cp1[key]]  # the evaluation logs at step 4 only
        assert {s: again[s] for s in steps} == {s: cp1[key][s] for s in steps}, (key, again, cp1[key])
