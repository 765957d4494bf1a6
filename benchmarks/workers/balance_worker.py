"""Rank worker of the load-balance benchmark: CPU time each rank spends in attention kernels.

Usage: ``python -m benchmarks.workers.balance_worker OUT_DIR SPEC_JSON`` with
``SPEC_JSON`` = ``{"cp_sizes": [2, 4, 8], "layouts": {"contiguous": "varlen_llama3",
"zigzag": "batch_zigzag"}, "length": 8192, "heads": 4, "kv_heads": 2,
"head_dim": 16, "repeats": 3}``.

For each CP size and layout the first group of ranks shards one causal sequence
with cptune's ring-flash-attn backend (``varlen_llama3`` keeps contiguous slices,
``batch_zigzag`` zigzag chunks), then runs attention forward and backward on
random bf16 query/key/value of this rank's shard through the backend's attention
call. :class:`benchmarks.memtrace.KernelClock` charges each rank the thread CPU
time of its kernel calls, which does not count time spent waiting for a core
(there may be fewer cores than ranks) or for a peer.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from benchmarks.common import write_rank_report
from benchmarks.memtrace import KernelClock
from benchmarks.workers.shardstep import init_world, make_batch, make_recipe, setup_backend


def attention_work(call: Any, spec: dict[str, Any], tokens: int, seed: int) -> dict[str, float]:
    """Forward and backward of one attention layer through ``call``; kernel and total CPU time."""
    generator = torch.Generator().manual_seed(seed)

    def rand(heads: int) -> torch.Tensor:
        shape = (1, tokens, heads, spec["head_dim"])
        return torch.randn(shape, generator=generator).to(torch.bfloat16).requires_grad_()

    q, k, v = rand(spec["heads"]), rand(spec["kv_heads"]), rand(spec["kv_heads"])
    grad = torch.randn((1, tokens, spec["heads"], spec["head_dim"]), generator=generator).to(torch.bfloat16)
    started = time.thread_time()
    out = call.attend(q, k, v, spec["head_dim"] ** -0.5)
    out.backward(grad)
    return {"attention_cpu_seconds": time.thread_time() - started}


def main() -> None:
    out_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    rank, world = init_world()
    clock = KernelClock()
    report: dict[str, Any] = {"rank": rank, "world_size": world, "runs": []}
    for cp in spec["cp_sizes"]:
        for layout, func in spec["layouts"].items():
            recipe = make_recipe(cp, cp_backend="ring-flash-attn", ring_attn_func=func, bf16=True)
            setup = setup_backend(recipe, rank, world)
            clock.install()
            if not setup.active:
                continue
            batch = make_batch(spec["length"])
            call = setup.backend.shard(batch).call
            tokens = spec["length"] // cp
            samples = []
            for repeat in range(spec["repeats"] + 1):  # the first is a warm-up
                clock.reset()
                work = attention_work(call, spec, tokens, seed=1000 * rank + repeat)
                if repeat:
                    samples.append({**work, "kernel_cpu_seconds": clock.seconds, "kernel_calls": clock.calls})
            report["runs"].append(
                {"cp_size": cp, "layout": layout, "func": func, "cp_rank": rank % cp, "samples": samples}
            )
    write_rank_report(out_dir, rank, report)


if __name__ == "__main__":
    main()
