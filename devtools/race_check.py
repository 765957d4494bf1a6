"""Run cptune's torch-backend ring attention under valgrind's race detectors and sort what they report.

Usage::

    python -m devtools.race_check [--tool helgrind|drd] [--iterations N] [--strategy allgather|alltoall]
    python -m devtools.race_check --summarize LOG_DIR [--tool helgrind|drd]

Issue 26 (a rank of a ``cp_backend: torch`` run aborting once with ``malloc(): unaligned tcache
chunk detected``, under load, never reproduced) asks whether two threads of a rank touch the same
memory unordered: the main thread, and gloo's worker and transport threads, which run the ring's
all-gathers and all-to-alls while attention goes on (in the backward an all-gather of K/V and an
all-to-all of their gradients are in flight together). memcheck serialises threads and cannot see
that; helgrind and drd can.

Two gloo ranks run the CPU path of ``cp_backend: torch`` (cptune's patch
``torch-cp-cpu-sdpa-handlers`` applied, query/key/value wrapped as DTensors sharded on the sequence
dim, torch's CP dispatcher on, forward and backward) on the rows of :mod:`devtools.torch_cp_stress`,
under the tool, one log per process (``LOG_DIR/<tool>.<pid>.log``), with Python's small-object
allocator off (``PYTHONMALLOC=malloc``: the tool sees every block) and one OpenMP thread (libgomp's
barriers are invisible to the tools and would flood the logs). The ranks do what
``TorchCpBackend._attend`` and ``step_context`` do without importing them: their module imports
transformers, which doubles the time the tool spends importing (most of a run).

The summary counts each log's reports and prints once per distinct stack those whose frames name
c10d, gloo, autograd, op dispatch or allocation, the reports that could explain a heap corrupted
by another thread; CPython's unsynchronised flags (the GIL's ``eval_breaker``) are only counted.

Slow: ``--iterations 3`` under helgrind took 784 CPU seconds in all (37 minutes at load 10-17); the\nranks reach their first step after about 5 CPU minutes each (importing torch is most of it).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SUSPECT_FRAMES = re.compile(
    r"gloo|c10d|ProcessGroup|autograd|Dispatcher|OperatorEntry|malloc|free|operator new|operator delete"
    r"|StorageImpl|TensorImpl|intrusive_ptr"
)
"""Frames that make a report worth reading: the collectives' threads, autograd, op dispatch, allocation."""

REPORT_START = re.compile(
    r"^(Possible data race|Conflicting (load|store)|Lock order|Probably a race|Destroying"
    r"|Thread #?\d+(: |'s call| unlocked))"
)
FRAME = re.compile(r"^\s+(at|by) 0x[0-9A-F]+: (.*?)(?: \(.*\))?$")


def rank_loop(iterations: int, strategy: str) -> None:
    """One rank: ``iterations`` forward+backward steps of torch's CP ring attention with cptune's CPU handlers."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import _context_parallel as torch_cp

    from cptune.parallel.backends.torch_cp.patches import torch_cp_cpu_sdpa_patch
    from cptune.patches.core import PatchSet, always
    from cptune.run.training.distributed import close_process_groups
    from devtools.torch_cp_stress import BATCH, HEAD_DIM, HEADS, KV_HEADS, ROW_LENGTHS

    # The tools slow a rank down a hundredfold; its peer must not give up on it.
    dist.init_process_group("gloo", timeout=timedelta(hours=2))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))["cp"]
    generator = torch.Generator().manual_seed(1234 + dist.get_rank())
    rotate = {"allgather": torch_cp._RotateMethod.ALL_GATHER, "alltoall": torch_cp._RotateMethod.ALL_TO_ALL}

    def step(tokens: int) -> None:
        local = tokens // 2
        q, k, v = (
            torch.randn(BATCH, local, heads, HEAD_DIM, generator=generator, requires_grad=True)
            for heads in (HEADS, KV_HEADS, KV_HEADS)
        )
        grad_out = torch.randn(BATCH, local, HEADS, HEAD_DIM, generator=generator)
        torch_cp._cp_options.enable_load_balance = True
        torch_cp._cp_options.rotate_method = rotate[strategy]
        torch_cp._enable_context_parallel_dispatcher()
        try:
            q_, k_, v_ = (
                DTensor.from_local(t.transpose(1, 2), mesh, [Shard(2)], run_check=False) for t in (q, k, v)
            )
            out = F.scaled_dot_product_attention(
                q_, k_, v_, is_causal=True, scale=HEAD_DIM**-0.5, enable_gqa=True
            )
            out.to_local().transpose(1, 2).backward(grad_out)
        finally:
            torch_cp._disable_context_parallel_dispatcher()

    with PatchSet([torch_cp_cpu_sdpa_patch(always)]).applied(None):
        for iteration in range(iterations):
            step(ROW_LENGTHS[iteration % len(ROW_LENGTHS)])
    dist.barrier()
    close_process_groups()  # as cptune's own ranks end: no gloo thread left for shutdown


def launch(tool: str, iterations: int, strategy: str, log_dir: Path) -> int:
    """Both ranks under ``tool``; the exit code of the first that failed, else 0."""
    from devtools.two_ranks import run_two_ranks

    extra = ["--history-level=full", "--conflict-cache-size=2000000"] if tool == "helgrind" else []
    valgrind = [
        "valgrind",
        f"--tool={tool}",
        "--num-callers=40",
        *extra,
        f"--log-file={log_dir}/{tool}.%p.log",
    ]
    rank = [sys.executable, "-m", "devtools.race_check", "--rank-process", f"--iterations={iterations}"]
    env = {
        **os.environ,
        "PYTHONMALLOC": "malloc",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    codes = run_two_ranks([*valgrind, *rank, f"--strategy={strategy}"], env=env, cwd=REPO)
    return next((code for code in codes if code), 0)


def reports(log: str) -> list[list[str]]:
    """The tool's error reports in one log, each as its lines without the ``==pid==`` prefix."""
    found: list[list[str]] = []
    current: list[str] | None = None
    for raw in log.splitlines():
        line = re.sub(r"^==\d+== ?", "", raw)
        if REPORT_START.match(line):
            current = [line]
            found.append(current)
        elif line.startswith(("----", "HEAP SUMMARY", "ERROR SUMMARY")):
            current = None
        elif current is not None:
            current.append(line)
    return found


def signature(report: list[str], depth: int = 6) -> tuple[str, ...]:
    """What tells two reports apart: their kind and the functions at the top of each stack."""
    kind = re.sub(r"0x[0-9A-Fa-f]+|\d+", "N", report[0])
    frames = [match.group(2) for line in report if (match := FRAME.match(line))]
    return (kind, *frames[:depth])


def summarize(log_dir: Path, tool: str) -> int:
    """Print each log's report count and every distinct suspect report; return how many suspects."""
    suspects: dict[tuple[str, ...], list[str]] = {}
    seen: collections.Counter[tuple[str, ...]] = collections.Counter()
    for path in sorted(log_dir.glob(f"{tool}.*.log")):
        text = path.read_text(errors="replace")
        command = next((line for line in text.splitlines() if "Command:" in line), "")
        found = reports(text)
        print(f"{path.name}: {len(found)} reports  {command.split('Command:')[-1].strip()[:100]}")
        for report in found:
            key = signature(report)
            seen[key] += 1
            frames = [line for line in report if FRAME.match(line)]
            if key not in suspects and any(SUSPECT_FRAMES.search(line) for line in frames):
                suspects[key] = report
    for key, report in suspects.items():
        print(f"\n=== {seen[key]}x {key[0]}")
        print("\n".join(report))
    print(f"\n{len(suspects)} distinct suspect reports of {len(seen)} distinct reports")
    return len(suspects)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", choices=("helgrind", "drd"), default="helgrind")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--strategy", choices=("allgather", "alltoall"), default="allgather")
    parser.add_argument("--summarize", type=Path, metavar="LOG_DIR", help="only sort the logs already there")
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        rank_loop(args.iterations, args.strategy)
        return
    if args.summarize:
        summarize(args.summarize, args.tool)
        return
    log_dir = Path(tempfile.mkdtemp(prefix=f"cptune-{args.tool}-"))
    code = launch(args.tool, args.iterations, args.strategy, log_dir)
    print(f"ranks' exit code {code}; logs in {log_dir}")
    summarize(log_dir, args.tool)
    sys.exit(code)


if __name__ == "__main__":
    main()
