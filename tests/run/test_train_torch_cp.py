"""`cptune train` with cp_backend: torch: dp=2×cp=2 equals cp=1; packed and padded batches never train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.collective_audit import EVAL_TOTALS, STEP_TARGETS, THROUGHPUT
from tests.conftest import logged, lora_recipe, max_rel_diff, run_cptune
from tests.dist_utils import run_ranks
from tests.numerics import logged_tolerance
from tests.run.one_process import one_process_reference

REFUSAL_WORKER = Path(__file__).with_name("torch_refusal_worker.py")


# The runs of the test below: a full fine-tune of unpacked rows, SGD with gradient accumulation 2.
TORCH_KEYS = dict(
    max_steps=4,
    sample_packing=False,
    cp_backend="torch",
    adapter=None,
    optimizer="sgd",
    learning_rate=0.05,
    gradient_accumulation_steps=2,
    val_set_size=5,  # rows over 2 data-parallel groups: one evaluates a filler row
    eval_steps=4,
    save_steps=2,  # checkpoints are written under the collective audit too
)


@one_process_reference("torch-cp", "test_torch_dp2xcp2_and_fsdp2_full_finetune_match_cp1_step_by_step")
def cp1_reference(folder: Path, tiny_model_dir: Path) -> list[Path]:
    """The cp=1 run of :data:`TORCH_KEYS`, into ``folder / "cp1"``."""
    keys = {**TORCH_KEYS, "context_parallel_size": 1, "output_dir": str(folder / "cp1")}
    return [lora_recipe(folder, tiny_model_dir, "cp1.yaml", **keys)]


@pytest.mark.distributed
def test_torch_dp2xcp2_and_fsdp2_full_finetune_match_cp1_step_by_step(
    write_recipe, tmp_path, collective_audit, one_process_runs
):
    """Full fine-tune with SGD and gradient accumulation 2: losses, gradient norms and eval loss equal cp=1's.

    Unpacked rows, padded to the longer row of a batch: causal attention never shows the
    padding to a trained token, so the torch backend takes them. dp=2 groups of micro batch 1
    (plain DDP) train the rows cp=1 trains as micro batch 2; cp=2 with FSDP2 over both ranks
    trains cp=1's batches as they are. SGD, so a wrong gradient scale shows (see
    test_train_e2e.py). The torch backend's LoRA runs are in tests/parallel/test_parity.py.
    The cp=1 run trains in the session's one process of cp=1 references (tests/run/one_process.py);
    the CP runs are `cptune train`'s own launches.
    """
    references = one_process_runs["torch-cp"]
    # The data the cp=1 run prepared.
    recipe = write_recipe(**TORCH_KEYS, dataset_prepared_path=str(references / "prepared"))
    runs = {
        "dp2xcp2": ["--context_parallel_size=2", "--micro_batch_size=1", "--nproc-per-node", "4"],
        "fsdp2-cp2": ["--context_parallel_size=2", "--fsdp_version=2"],
    }
    logs = {"cp1": {key: logged(references / "cp1", key) for key in ("loss", "grad_norm", "eval_loss")}}
    for name, extra in runs.items():
        out = tmp_path / name
        done = run_cptune("train", str(recipe), f"--output_dir={out}", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        logs[name] = {key: logged(out, key) for key in ("loss", "grad_norm", "eval_loss")}
    assert "torch-cp-cpu-sdpa-handlers" in done.stderr  # dp2xcp2 ran torch's CP, through the CPU patch
    assert len(logs["cp1"]["loss"]) == 4 and len(set(logs["cp1"]["loss"].values())) > 1
    for name in ("dp2xcp2", "fsdp2-cp2"):
        diffs = {key: max_rel_diff(logs[name][key], logs["cp1"][key]) for key in logs["cp1"]}
        print(f"torch {name} max rel diff vs cp=1:", diffs)
        # Bound (tests/numerics.py): rows of 128 tokens, 4 a step (2 x accumulation 2), 5 evaluated.
        assert max(diffs.values()) <= logged_tolerance(128, 5), (name, diffs, logs[name], logs["cp1"])
    assert (tmp_path / "dp2xcp2" / "checkpoint-4").is_dir()
    # The saved model generates with a KV cache, as the base model did (training passes use_cache=False).
    assert json.loads((tmp_path / "dp2xcp2" / "config.json").read_text())["use_cache"] is True
    collective_audit.check(STEP_TARGETS, THROUGHPUT, EVAL_TOTALS)


@pytest.mark.e2e
def test_packed_recipe_is_refused_before_any_work(write_recipe, tmp_path):
    done = run_cptune("train", str(write_recipe(context_parallel_size=2, cp_backend="torch")))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert "sample_packing: cp_backend: torch cannot keep packed samples apart" in done.stderr
    assert "Use cp_backend: ring-flash-attn" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_packed_and_padded_batches_stop_training_at_the_first_batch(write_recipe, tmp_path):
    """Past validation (recipes built without its combination rules), the backend refuses the batch itself."""
    packed = write_recipe(
        "packed.yaml", context_parallel_size=2, cp_backend="torch", output_dir=str(tmp_path / "packed")
    )
    padded = write_recipe(
        "padded.yaml",
        context_parallel_size=2,
        cp_backend="torch",
        causal=False,
        sample_packing=False,
        pad_to_sequence_len=True,  # every row is padded to 128 tokens, from the first batch on
        output_dir=str(tmp_path / "padded"),
    )
    results = run_ranks(REFUSAL_WORKER, 2, tmp_path / "ranks", str(packed), str(padded), bitsandbytes=False)
    expected = {
        str(packed): "UnmaskableBatchError: cp_backend: torch cannot mask packed documents",
        str(padded): "UnmaskableBatchError: cp_backend: torch cannot mask padding or packed documents "
        "with causal: false",
    }
    for per_rank in results:
        for recipe, start in expected.items():
            run = per_rank[recipe]
            assert run["error"] is not None and run["error"].startswith(start), run
            assert "Use cp_backend: ring-flash-attn" in run["error"]
            assert run["forwards"] == 0 and run["optimizer_steps"] == 0, run
            assert not run["wrote_train_log"]
