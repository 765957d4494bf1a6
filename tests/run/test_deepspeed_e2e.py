"""cp_backend: deepspeed through `cptune train`, as a user runs it: the quickstart equals its cp=1 run.

ZeRO-3 on dp=2 × cp=2 against the cp=1 run, with SGD, gradient accumulation 3 and
``lora_dropout: 0.1``. DeepSpeed averages the gradients over all 4 ranks at every ZeRO stage
(cptune gives it no sequence-parallel group; every stage's division is checked against hand-reduced
gradients in tests/parallel/test_ulysses_parity.py) and ZeRO-3 gathers every weight from every rank
in each forward, evaluation included. Gradient accumulation 3 is no multiple of cp: DeepSpeed's own
Ulysses loader, which cptune used before, trained each group's batches of its 2 ranks one after
another, so a step held other rows than the cp=1 run's step (measured with that loader: the losses
5.4% and the gradient norms 83% off the cp=1 run's). Compared step by step: the loss, the gradient
norm the Trainer logs (a wrong gradient scale shows there at once; SGD without clipping carries it
into the later losses) and the eval loss. The evaluation set packs into one row, split unevenly over the 2
data-parallel groups: ZeRO-3 would wait for ever in a forward that the ranks without a row never run
(measured before the fix: every rank stopped at ddp_timeout), unless every rank runs as many.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cptune.config.loader import parse_override
from tests.collective_audit import EVAL_TOTALS, STEP_TARGETS, THROUGHPUT
from tests.conftest import REPO, logged, max_rel_diff, run_cptune, shipped_example
from tests.numerics import logged_tolerance
from tests.run.one_process import one_process_reference

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")


QUICKSTART = REPO / "examples" / "quickstart.yaml"
# The runs of the test below, on top of the quickstart recipe.
COMMON = [
    "--max_steps=4",
    "--logging_steps=1",
    "--sequence_len=256",
    "--gradient_accumulation_steps=3",
    "--optimizer=sgd",
    "--learning_rate=0.05",
    "--warmup_steps=0",
    # No clipping: a clipped update is as blind to a gradient scale as AdamW's.
    "--max_grad_norm=0",
    "--lora_dropout=0.1",
    "--val_set_size=5",
    "--eval_steps=4",
]


@one_process_reference(
    "deepspeed-quickstart", "test_quickstart_with_deepspeed_zero3_dp2xcp2_matches_cp1_step_by_step"
)
def cp1_reference(folder: Path, tiny_model_dir: Path) -> list[Path]:
    """The quickstart with :data:`COMMON` at cp=1, as ``cptune train`` reads those flags, into ``folder / "cp1"``."""
    keys = {
        **shipped_example(QUICKSTART, folder, "cp1"),
        **dict(map(parse_override, [*COMMON, "--context_parallel_size=1"])),
    }
    recipe = folder / "cp1.yaml"
    recipe.write_text(yaml.safe_dump(keys))
    return [recipe]


@pytest.mark.distributed
def test_quickstart_with_deepspeed_zero3_dp2xcp2_matches_cp1_step_by_step(
    tmp_path, collective_audit, one_process_runs
):
    # The cp=1 run trains in the session's one process of cp=1 references (tests/run/one_process.py).
    references = one_process_runs["deepspeed-quickstart"]
    common = [*COMMON, f"--dataset_prepared_path={references / 'prepared'}"]  # the data the cp=1 run prepared
    # ZeRO-3 keeps parameters below stage3_param_persistence_threshold (1e5 elements by default, so
    # all of the tiny model's) whole on every rank; 0 partitions them all, as a real model's are.
    ds_config = tmp_path / "zero3.json"
    ds_config.write_text(
        json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    )
    # dp=2 groups of micro batch 1 train the rows the cp=1 run trains as micro batch 2.
    zero3 = [
        "--cp_backend=deepspeed",
        "--ring_attn_func=null",
        f"--deepspeed={ds_config}",
        "--micro_batch_size=1",
        "--nproc-per-node",
        "4",
    ]
    out = tmp_path / "zero3"
    done = run_cptune(
        "train", "examples/quickstart.yaml", f"--output_dir={out}", *common, *zero3, cwd=REPO, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    logs = {
        name: {key: logged(folder, key) for key in ("loss", "grad_norm", "eval_loss")}
        for name, folder in (("cp1", references / "cp1"), ("zero3", out))
    }
    expected = logs["cp1"]
    assert len(expected["loss"]) == 4 and len(set(expected["loss"].values())) > 1
    diffs = {key: max_rel_diff(logs["zero3"][key], expected[key]) for key in expected}
    print("ZeRO-3 dp2xcp2 max rel diff vs cp=1:", diffs)
    # Bound (tests/numerics.py): rows of 256 tokens, 6 a step (dp 2 x accumulation 3), 5 evaluated.
    assert max(diffs.values()) <= logged_tolerance(256, 6), (diffs, logs)
    collective_audit.check(STEP_TARGETS, THROUGHPUT, EVAL_TOTALS)

    assert json.loads((out / "adapter_config.json").read_text())["r"] == 16
    history = json.loads((out / "train_log.json").read_text())
    step = next(entry for entry in history if "tokens_per_second" in entry)
    # The Trainer sees all 4 processes (DeepSpeed on CPU reported 1 before cptune's patch).
    assert step["tokens_per_second_per_process"] == pytest.approx(step["tokens_per_second"] / 4, abs=0.1)
