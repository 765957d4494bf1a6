"""Stress cptune's torch-backend attention on CPU: torch's ring over gloo, forward and backward, many times.

Usage::

    python -m devtools.torch_cp_stress [--iterations N] [--strategy allgather|alltoall ...] [--no-balance] [--jitter]

starts two gloo processes (the launcher's environment, as ``cptune train`` gives its ranks) that run
fixed query/key/value rows of several lengths through :class:`~cptune.parallel.backends.torch_cp.sharding.TorchCpBackend`'s
attention with the CPU SDPA patch applied (the path of ``cp_backend: torch`` on CPU: DTensor dispatch,
cptune's handlers, torch's ring templates, functional collectives on gloo), ``N`` times, backward
included. Between iterations each rank collects garbage and churns the heap (tensors and bytes of
many sizes allocated and freed), so that a buffer freed while a gloo thread still writes into it, or
read after it was reused, changes a number or trips glibc's checks (run it in the environment of
:func:`devtools.heap_checks.heap_checks`: ``MALLOC_CHECK_=3`` needs ``libc_malloc_debug.so`` preloaded since
glibc 2.34). Every iteration's output and gradients are compared bitwise with the
first of the same length: the computation is deterministic, so any difference is corruption, not rounding.

``--jitter`` makes each rank sleep a random 0-4 ms (its own seed) before and after most issues of
the ring's collectives (all-gather, all-to-all) and waits on them, so that the two ranks, and a rank's
main thread and gloo's threads, meet in orders a quiet machine never produces (issue 26's abort was
seen only under load).

Each rank prints one JSON line (iterations, mismatches, the first mismatching iteration); the
command exits non-zero when a rank failed or saw a mismatch. A rank that dies of a signal prints
every thread's Python stack (``faulthandler``).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import sys
from datetime import timedelta

# The attention of examples/quickstart.yaml's tiny Llama: 4 query heads sharing 2 key/value heads,
# head_dim 16, micro_batch_size 2.
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
COLLECTIVE_TIMEOUT_SECONDS = 300
JITTER_PROBABILITY, JITTER_SECONDS = 0.6, 0.004
ROW_LENGTHS = (512, 32, 44, 8, 128, 20)
"""Tokens per row (both ranks together), one per iteration in turn: a packed 512-token row, and the short
padded rows of ``sample_packing: false`` (multiples of 2 × context_parallel_size, as the backend pads)."""


def churn(generator) -> None:
    """Allocate and free blocks of many sizes, so freed memory is reused at once."""
    import torch

    keep = []
    for size in torch.randint(1, 1 << 16, (64,), generator=generator).tolist():
        block = torch.empty(size)
        block.fill_(float(size))
        keep.append(block)
        keep.append(bytearray(size % 4096 + 1))
    del keep
    gc.collect()


def add_jitter(seed: int) -> None:
    """Random sleeps around the issue and the wait of every collective torch's ring attention makes."""
    import random
    import time

    import torch.distributed._functional_collectives as ft_c
    from torch.distributed.tensor.experimental._context_parallel import _attention

    rng = random.Random(seed)

    def jittered(call):
        def sleep_around(*args, **kwargs):
            if rng.random() < JITTER_PROBABILITY:
                time.sleep(rng.random() * JITTER_SECONDS)
            result = call(*args, **kwargs)
            if rng.random() < JITTER_PROBABILITY:
                time.sleep(rng.random() * JITTER_SECONDS)
            return result

        return sleep_around

    # The ring's rotaters call these module attributes (torch 2.13 _attention.py:253-300).
    ft_c.all_gather_single = jittered(ft_c.all_gather_single)
    ft_c.permute_tensor = jittered(ft_c.permute_tensor)
    _attention._maybe_wait = jittered(_attention._maybe_wait)


def rank_main(iterations: int, strategies: list[str], balance: bool, jitter: bool = False) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cptune.parallel.backends.torch_cp.patches import torch_cp_cpu_sdpa_patch
    from cptune.parallel.backends.torch_cp.sharding import TorchCpBackend
    from cptune.patches.core import PatchSet, always
    from cptune.patches.torch_patches import gloo_one_worker_patch
    from cptune.run.training.distributed import close_process_groups

    # As `cptune train` does before any process group exists: gloo groups with one worker thread (two
    # corrupt the heap when collectives finish together: devtools/gloo_status_race.py).
    PatchSet([gloo_one_worker_patch()]).apply(None)
    # A rank left waiting for a dead peer gives up instead of outliving the command.
    dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))["cp"]
    generator = torch.Generator().manual_seed(1234 + rank)
    if jitter:
        add_jitter(seed=99 + rank)

    def inputs(tokens: int) -> list:
        local = tokens // 2
        shapes = [(HEADS, local), (KV_HEADS, local), (KV_HEADS, local), (HEADS, local)]
        return [torch.randn(BATCH, n, heads, HEAD_DIM, generator=generator) for heads, n in shapes]

    def step(backend, query, key, value, grad_out) -> list:
        q, k, v = (t.clone().requires_grad_() for t in (query, key, value))
        with backend.step_context():
            out = backend._attend(q, k, v, HEAD_DIM**-0.5)
            out.backward(grad_out)
        return [out.detach(), q.grad, k.grad, v.grad]

    patch = torch_cp_cpu_sdpa_patch(always)
    cases = {tokens: inputs(tokens) for tokens in ROW_LENGTHS}
    report: dict = {"rank": rank, "iterations": iterations, "mismatches": 0, "strategies": {}}
    with PatchSet([patch]).applied(None):
        for strategy in strategies:  # one launch, each of torch's two rings in turn
            backend = TorchCpBackend(
                causal=True, load_balance=balance, comm_strategy=strategy, cp_mesh=mesh, pad_token_id=0
            )
            mismatches, first_mismatch = 0, None
            # Each iteration's results against the first of the same row length, bit for bit.
            reference = {tokens: step(backend, *case) for tokens, case in cases.items()}
            for iteration in range(iterations):
                tokens = ROW_LENGTHS[iteration % len(ROW_LENGTHS)]
                churn(generator)
                results = step(backend, *cases[tokens])
                if not all(torch.equal(a, b) for a, b in zip(results, reference[tokens], strict=True)):
                    mismatches += 1
                    first_mismatch = iteration if first_mismatch is None else first_mismatch
            report["strategies"][strategy] = {"mismatches": mismatches, "first_mismatch": first_mismatch}
            report["mismatches"] += mismatches
    dist.barrier()
    close_process_groups()  # as cptune's own ranks end: no gloo thread left for shutdown
    return report


def launch(argv: list[str]) -> int:
    from devtools.two_ranks import run_two_ranks

    codes = run_two_ranks([sys.executable, "-m", "devtools.torch_cp_stress", "--rank-process", *argv])
    return 0 if all(code == 0 for code in codes) else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument(
        "--strategy",
        action="append",
        choices=("allgather", "alltoall"),
        help="repeatable (default: allgather)",
    )
    parser.add_argument("--no-balance", dest="balance", action="store_false")
    parser.add_argument("--jitter", action="store_true", help="random sleeps around every collective")
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if not args.rank_process:
        sys.exit(launch(sys.argv[1:]))
    faulthandler.enable(all_threads=True)
    report = rank_main(args.iterations, args.strategy or ["allgather"], args.balance, args.jitter)
    sys.stdout.write(json.dumps(report) + "\n")  # one write: the two ranks share the stdout
    sys.stdout.flush()
    sys.exit(1 if report["mismatches"] else 0)


if __name__ == "__main__":
    main()
