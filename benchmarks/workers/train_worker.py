"""Rank worker that trains a recipe through cptune (or the plain HF baseline) and times every step.

Usage: ``python -m benchmarks.workers.train_worker OUT_DIR MODE RECIPE_YAML [TRAIN_ROWS]``

* ``MODE=cptune`` runs :func:`cptune.run.training.train.train`, what ``cptune train`` runs in
  every rank (started here with the same launcher environment).
* ``MODE=hf`` runs :func:`benchmarks.workers.hf_baseline.train_plain` on the rows in
  ``TRAIN_ROWS`` (the folder cptune prepared for the same recipe).

A :class:`StepProbe` callback records, per optimizer step, the wall and CPU time
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
from typing import Any

import torch
from transformers import TrainerCallback

from benchmarks.common import write_rank_report
from benchmarks.memtrace import AllocationTrace, reset_peak_rss, rss_status


class StepProbe(TrainerCallback):
    """Times and measures each optimizer step, boundary to boundary."""

    def __init__(self, trace_step: int | None):
        self.trace_step = trace_step
        self.steps: list[dict[str, Any]] = []
        self.startup_peak_rss: int | None = None
        self._trace: AllocationTrace | None = None
        self._mark: tuple[float, float, int] | None = None

    def _begin_interval(self, next_step: int) -> None:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        reset_peak_rss()
        rss = rss_status().get("VmRSS", 0)
        if next_step == self.trace_step and not cuda:
            self._trace = AllocationTrace()
            self._trace.__enter__()
        self._mark = (time.perf_counter(), time.process_time(), rss)

    def on_train_begin(self, args, state, control, **kwargs):
        self.startup_peak_rss = rss_status().get("VmHWM")
        self._begin_interval(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        now, cpu = time.perf_counter(), time.process_time()
        status = rss_status()
        started, cpu_started, rss = self._mark
        record: dict[str, Any] = {
            "step": state.global_step,
            "seconds": now - started,
            "cpu_seconds": cpu - cpu_started,
            "rss_growth": status.get("VmHWM", 0) - rss,
            "peak_rss": status.get("VmHWM"),
        }
        if cuda:
            record["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            result = self._trace.result
            record["tensor_peak"] = result.peak
            self._trace = None
        self.steps.append(record)
        self._begin_interval(state.global_step + 1)


def main() -> None:
    out_dir, mode, recipe_path = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    from cptune.config.loader import load_recipe
    from cptune.run.training.distributed import read_dist_env

    env = read_dist_env()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    recipe = load_recipe(recipe_path)
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
