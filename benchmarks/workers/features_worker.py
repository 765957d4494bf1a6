"""Rank worker of the memory-features benchmark: per-rank memory of one step with each feature on and off.

Usage: ``python -m benchmarks.workers.features_worker OUT_DIR SPEC_JSON`` with ``SPEC_JSON`` =
``{"cp_sizes": [1, 2], "length": 16384, "chunk_tokens": 512, "variants": {"name": {recipe keys}}}``.

For each CP size and variant, the active ranks (the first group, see
:mod:`benchmarks.workers.shardstep`) build the tiny Llama with LoRA and gradient
checkpointing and the variant's memory features, take a warm-up step (gradients and
optimizer state exist from then on) and trace the next one
(:class:`benchmarks.memtrace.AllocationTrace`): the peak above the model state, its part
outside attention kernels, the host memory the offloader held, and the step's CPU time.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from benchmarks.common import write_rank_report
from benchmarks.memtrace import AllocationTrace, KernelClock
from benchmarks.workers.shardstep import (
    VOCAB,
    ShardedStep,
    init_world,
    make_batch,
    make_recipe,
    setup_backend,
)


def measure(recipe: Any, setup: Any, length: int, chunk_elements: int, clock: KernelClock) -> dict[str, Any]:
    step = ShardedStep(recipe, setup, loss_chunk_elements=chunk_elements)
    batch = make_batch(length)
    step(batch)  # gradients and optimizer state exist from here on
    clock.install()
    cpu = time.process_time()
    with AllocationTrace() as trace:
        loss = step(batch)
    cpu = time.process_time() - cpu
    offloader = step.features.offloader
    report = {
        "loss": loss,
        "peak": trace.result.peak,
        "peak_outside_kernels": trace.result.peak_outside_kernels,
        "kernel_workspace": trace.result.kernel_workspace,
        "model_state": sum(step.model_state_bytes().values()),
        "host_peak": offloader.stats.peak_host_bytes if offloader is not None else 0,
        "step_cpu_seconds": cpu,
    }
    step.close()
    return report


def main() -> None:
    out_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    rank, world = init_world()
    clock = KernelClock()
    chunk = spec["chunk_tokens"] * VOCAB
    report: dict[str, Any] = {"rank": rank, "world_size": world, "per_cp": {}}
    for cp in spec["cp_sizes"]:
        entries: dict[str, Any] = {}
        # The backend does not depend on the memory features: one per CP size (one device mesh).
        setup = setup_backend(make_recipe(cp, gradient_checkpointing=True), rank, world)
        for name, keys in spec["variants"].items():
            recipe = make_recipe(cp, gradient_checkpointing=True, **keys)
            entry: dict[str, Any] = {"active": setup.active, "cp_rank": rank % cp}
            if setup.active:
                entry.update(measure(recipe, setup, spec["length"], chunk, clock))
            entries[name] = entry
        report["per_cp"][str(cp)] = entries
    write_rank_report(out_dir, rank, report)


if __name__ == "__main__":
    main()
