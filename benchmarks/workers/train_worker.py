"""Rank worker that trains a recipe through cptune (or the plain HF baseline) and times every step.

Usage: ``python -m benchmarks.workers.train_worker OUT_DIR MODE RECIPE_YAML [TRAIN_ROWS]``

* ``MODE=cptune`` runs :func:`cptune.run.training.train.train`, what ``cptune train`` runs in
  every rank (started here with the same launcher environment).
* ``MODE=hf`` runs :func:`benchmarks.workers.hf_baseline.train_plain` on the rows in
  ``TRAIN_ROWS`` (the folder cptune prepared for the same recipe).

A :class:`~benchmarks.workers.probes.StepProbe` callback records, per optimizer step, the wall and CPU time
from the end of the previous step to the end of this one (so data loading,
collation, the optimizer and logging are all inside), the growth of resident
memory (or of CUDA memory on a GPU), and, for the last step, the tensor-memory
trace of :class:`benchmarks.memtrace.AllocationTrace` (CPU only). Both get it
through their ``callbacks`` argument -- the same callback, the same place.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import write_rank_report


def main() -> None:
    out_dir, mode, recipe_path = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    from cptune.config.loader import load_recipe
    from cptune.run.training.distributed import read_dist_env
    from cptune.run.training.unused_imports import leave_out_bitsandbytes

    env = read_dist_env()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    recipe = load_recipe(recipe_path)
    leave_out_bitsandbytes([recipe])  # as a rank of `cptune train` does, before transformers is imported
    from benchmarks.workers.probes import StepProbe

    probe = StepProbe(trace_step=recipe.max_steps)
    started = time.perf_counter()
    if mode == "cptune":
        from cptune.run.training.train import train

        train(recipe, callbacks=[probe])
    elif mode == "hf":
        from benchmarks.workers.hf_baseline import train_plain

        train_plain(recipe, Path(sys.argv[4]), Path(recipe.output_dir), [probe])
    else:
        raise SystemExit(f"unknown mode {mode!r}; use cptune or hf")
    if not probe.steps:
        raise SystemExit("the step probe recorded nothing: the Trainer never reached it")
    report = {
        "mode": mode,
        "rank": env.rank,
        "world_size": env.world_size,
        "steps": probe.steps,
        "startup_peak_rss": probe.startup_peak_rss,
        "wall_seconds": time.perf_counter() - started,
        "sequence_len": recipe.sequence_len,
    }
    write_rank_report(out_dir, env.rank, report)


if __name__ == "__main__":
    main()
