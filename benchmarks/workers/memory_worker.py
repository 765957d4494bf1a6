"""Rank worker of the memory benchmark: per-rank memory of one training step at each CP size.

Usage: ``python -m benchmarks.workers.memory_worker OUT_DIR SPEC_JSON`` with
``SPEC_JSON`` = ``{"cp_sizes": [1, 2, 4], "length": 8192, "packed_documents": 8,
"budget_bytes": ..., "grid": 1024, "first_probe_per_rank": 2048, "max_probes": 5}``.

For each CP size (the first group of ranks computes, see
:mod:`benchmarks.workers.shardstep`) the active ranks measure, at the fixed
``length``: model state, the step's tensor-memory peak and how it splits between
attention kernels and the rest (:class:`benchmarks.memtrace.AllocationTrace`), the
step's resident-memory growth, and its time. Then all ranks search together for
the longest sequence whose per-rank memory (model state + step peak, the largest
over the ranks) fits ``budget_bytes`` (:mod:`benchmarks.budget_search`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from benchmarks.budget_search import bracket, next_probe
from benchmarks.common import write_rank_report
from benchmarks.memtrace import AllocationTrace, KernelClock, reset_peak_rss, rss_status
from benchmarks.workers.shardstep import (
    ShardedStep,
    agree_max,
    describe_backend,
    init_world,
    make_batch,
    make_recipe,
    setup_backend,
)


def traced_step(step: ShardedStep, batch: Any) -> dict[str, int]:
    """Tensor memory of one step above the state at its start (model state included separately)."""
    with AllocationTrace() as trace:
        step(batch)
    result = trace.result
    state = sum(step.model_state_bytes().values())
    return {
        "model_state": state,
        "peak": result.peak,
        "kernel_workspace": result.kernel_workspace,
        "peak_outside_kernels": result.peak_outside_kernels,
        "total": state + result.peak,
        "total_outside_kernels": state + result.peak_outside_kernels,
    }


def measure_fixed(
    step: ShardedStep, length: int, packed_documents: int, clock: KernelClock
) -> dict[str, Any]:
    """Warm-up, one timed step with the resident-memory check, one traced step, one traced packed step."""
    batch = make_batch(length)
    step(batch)  # creates gradients and optimizer state: model state from here on
    rss_reset = reset_peak_rss()
    before = rss_status()
    clock.reset()
    wall, cpu = time.perf_counter(), time.process_time()
    step(batch)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = rss_status()
    report: dict[str, Any] = {
        "model_state_parts": step.model_state_bytes(),
        "step_seconds": wall,
        "step_cpu_seconds": cpu,
        "kernel_cpu_seconds": clock.seconds,
        "rss_step_growth": (after["VmHWM"] - before["VmRSS"]) if rss_reset and after else None,
        "rss_before": before.get("VmRSS"),
    }
    report.update(traced_step(step, batch))
    # The same tokens as packed documents: how the backend keeps documents apart costs memory too.
    documents = [length // packed_documents] * packed_documents
    report["packed"] = traced_step(step, make_batch(length, documents))
    return report


def search_budget(step: ShardedStep | None, spec: dict[str, Any], cp: int) -> dict[str, Any]:
    """Longest length (multiple of ``grid``) whose largest per-rank memory fits the budget.

    Every rank calls this in step; ranks without a ``step`` (idle groups) report zero.
    """
    budget, grid = spec["budget_bytes"], spec["grid"]
    measured: dict[int, float] = {}
    outside: dict[int, float] = {}
    length: int | None = max(grid, spec["first_probe_per_rank"] * cp // grid * grid)
    while length is not None and len(measured) < spec["max_probes"]:
        local = (
            traced_step(step, make_batch(length))
            if step is not None
            else {"total": 0, "total_outside_kernels": 0}
        )
        total, total_outside = agree_max([local["total"], local["total_outside_kernels"]])
        measured[length], outside[length] = total, total_outside
        length = next_probe(measured, budget, grid)
    lo, hi = bracket(measured, budget)
    return {
        "budget_bytes": budget,
        "grid": grid,
        "longest_fitting": lo,
        "shortest_exceeding": hi,
        "resolved": lo is not None and hi is not None and hi - lo <= grid,
        "probes": {str(k): v for k, v in sorted(measured.items())},
        "probes_outside_kernels": {str(k): v for k, v in sorted(outside.items())},
    }


def main() -> None:
    out_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    rank, world = init_world()
    clock = KernelClock()
    report: dict[str, Any] = {"rank": rank, "world_size": world, "per_cp": {}}
    for cp in spec["cp_sizes"]:
        recipe = make_recipe(cp)
        setup = setup_backend(recipe, rank, world)
        if cp > 1:
            clock.install()  # the ring-flash-attn kernels are imported by now
        step = ShardedStep(recipe, setup) if setup.active else None
        entry: dict[str, Any] = {
            "active": setup.active,
            "cp_rank": rank % cp,
            "backend": describe_backend(recipe),
        }
        if step is not None:
            entry["fixed"] = measure_fixed(step, spec["length"], spec["packed_documents"], clock)
        if spec.get("budget_bytes"):
            entry["budget"] = search_budget(step, spec, cp)
        report["per_cp"][str(cp)] = entry
        if step is not None:
            step.close()
    write_rank_report(out_dir, rank, report)


if __name__ == "__main__":
    main()
