"""Reproduce issue 26's heap corruption with torch alone: two gloo collectives in flight at once.

Usage::

    python -m devtools.gloo_status_race [--iterations N] [--one-worker]

Two gloo ranks issue an all-gather (``funcol.all_gather_single``) and an all-to-all
(``funcol.permute_tensor``) of a small tensor together and wait on both, ``N`` times: what the backward
of torch's ring attention does in every layer under ``cp_backend: torch``. torch 2.13's
``ProcessGroupGloo::runLoop`` writes ``pgStatus_->lastCompletedWorkName = opTypeToString(...)`` after
each collective, outside ``workMutex_``; the process group's two worker threads (``threads``, default 2)
then move-assign into one ``std::string`` together. The two names differ in length
(``ALLGATHER_COALESCED``, 19 characters, on the heap; ``ALLTOALL_BASE``, 13, in the string itself), so
one thread can free the string's heap buffer while the other copies characters into it: glibc
aborts the rank with ``malloc(): unaligned tcache chunk detected`` (or a double free), and its peer
then loses the connection. helgrind reports the race (:mod:`devtools.race_check`: a worker's
``memmove`` in ``runLoop`` into a 20-byte block the other worker allocated in ``opTypeToString``).

``--one-worker`` applies cptune's fix, the patch ``gloo-one-worker-thread``
(cptune/patches/torch_patches.py): every gloo process group gets one worker thread, so no two
``runLoop`` bodies run together. Prints each rank's line and the ranks' exit codes; a code
of -6 is the abort.

The race needs a worker preempted inside a few instructions, so it is a matter of chance: on the
2-core machine at load 10-17, launches of 20000 iterations with two OpenMP threads per rank
(``OMP_NUM_THREADS=2``; the launcher's default is 1) aborted in 3 of 5; with one OpenMP thread,
in none of 4 (140000 iterations); with one worker thread (the same options the patch sets), 2 x 20000 iterations without an abort.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
from datetime import timedelta

TIMEOUT = timedelta(seconds=120)


def rank_main(iterations: int, one_worker: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from cptune.patches import PatchSet
    from cptune.patches.torch_patches import gloo_one_worker_patch
    from cptune.run.training.distributed import close_process_groups

    if one_worker:  # cptune's fix, applied for the process's life
        PatchSet([gloo_one_worker_patch()]).apply(None)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    world = dist.group.WORLD
    workers = world._get_backend(torch.device("cpu")).options._threads
    block = torch.ones(8)
    for _ in range(iterations):
        gathered = funcol.all_gather_single(block, 0, world)
        rotated = funcol.permute_tensor(block, [1, 0], world)
        gathered.wait()
        rotated.wait()
    dist.barrier()
    print(f"rank {dist.get_rank()}: {iterations} iterations, {workers} gloo worker threads", flush=True)
    close_process_groups()  # as cptune's own ranks end: no gloo thread left for shutdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument(
        "--one-worker",
        action="store_true",
        help="apply cptune's gloo-one-worker-thread patch (torch's default: 2 worker threads per group)",
    )
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        faulthandler.enable(all_threads=True)
        rank_main(args.iterations, args.one_worker)
        return
    from devtools.two_ranks import run_two_ranks

    codes = run_two_ranks(
        [sys.executable, "-m", "devtools.gloo_status_race", "--rank-process", *sys.argv[1:]]
    )
    print(f"exit codes {codes}")
    sys.exit(0 if all(code == 0 for code in codes) else 1)


if __name__ == "__main__":
    main()
