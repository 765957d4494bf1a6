"""`cptune train` with cp_backend: torch: cp=2 equals cp=1; packed and padded batches never train."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import logged_losses, run_cptune
from tests.dist_utils import run_ranks

REFUSAL_WORKER = Path(__file__).with_name("torch_refusal_worker.py")


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.distributed
def test_torch_cp2_matches_cp1_step_by_step(write_recipe, tmp_path):
    # Unpacked rows, micro batch 2: rows are padded to the longer one, which causal
    # attention never shows to a trained token, so the torch backend takes them.
    recipe = write_recipe(max_steps=5, sample_packing=False, cp_backend="torch")
    losses = {}
    for cp in (1, 2):
        out = tmp_path / f"cp{cp}"
        done = run_cptune("train", str(recipe), f"--output_dir={out}", f"--context_parallel_size={cp}")
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        losses[cp] = logged_losses(out)
    assert "torch-cp-cpu-sdpa-handlers" in done.stderr  # cp=2 ran torch's CP, through the CPU patch
    assert len(losses[1]) == 5 and len(set(losses[1])) > 1
    assert max(rel(a, b) for a, b in zip(losses[2], losses[1], strict=True)) <= 1e-5, losses


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
    results = run_ranks(REFUSAL_WORKER, 2, tmp_path / "ranks", str(packed), str(padded))
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
