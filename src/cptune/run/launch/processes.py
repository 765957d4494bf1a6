"""Start the processes of a run.

On one node cptune starts its own processes (one per rank, the torchrun
environment variables set for each) so that it can stop them all as soon as one
fails, and report which rank failed, instead of leaving the others waiting in a
collective. Multi-node launches go through torchrun with the user's rendezvous
arguments. Either way, a launcher that is told to stop (Ctrl-C, or SIGTERM from
``kill`` or a scheduler) passes the signal on, so no rank is left running.

Why one node does not use torchrun (checked against torch 2.13's
``torch/distributed/run.py``, ``launcher/api.py``, ``elastic/agent/server/`` and
``elastic/multiprocessing/``). torchrun also stops the other workers when one fails,
but what the user and a scheduler see differs:

- **Exit code.** torchrun's ``main`` is wrapped in ``@record`` and ends by raising
  ``ChildFailedError`` (a failed rank) or ``SignalException`` (SIGTERM/SIGINT to
  torchrun), so it exits 1 whatever happened: a rank's exit code 3 or a SIGKILL from
  the OOM killer both become 1, and a cancelled job is not 143. cptune exits with the
  failing rank's own code (1 for a rank ended by a signal), 130 after Ctrl-C and 143
  after SIGTERM, as a shell reports them.
- **What is printed.** torchrun prints the launcher's own Python traceback and a
  ``ChildFailedError`` table (45 lines for two ranks where rank 1 exits 3). cptune
  prints one line: which rank failed with which code or signal, and how each other
  rank ended (on its own, or sent SIGTERM/SIGKILL by cptune).
- **Grace.** torchrun's agent sends SIGTERM to every remaining worker as soon as it
  sees the failure (``LocalElasticAgent._shutdown`` → ``PContext.close``; SIGKILL
  after ``--shutdown-timeout``, 30 s). cptune first gives the other ranks
  :data:`GRACE_SECONDS` to exit on their own, so a rank that fails for the same reason
  prints its own message and code, then SIGTERM, then SIGKILL after the same grace.

What torchrun has and cptune's launcher lacks (restarts, elastic membership, a
rendezvous across nodes, per-rank log files, error files from ``@record``) matters
for multi-node jobs, which therefore go through torchrun. The ranks run the same code
either way: :func:`child_environment` sets the variables torch.distributed, accelerate
and the Trainer read (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``OMP_NUM_THREADS``), not torchrun's
bookkeeping ones (``TORCHELASTIC_*``, ``ROLE_*``, ``GROUP_WORLD_SIZE``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cptune.errors import LaunchError

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe

# How long the other ranks get to exit on their own after one rank failed.
GRACE_SECONDS = 10.0


@dataclass(frozen=True)
class LaunchPlan:
    """How many processes to start, and where."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


def default_nproc_per_node(recipe: Recipe, gpu_count: int) -> int:
    """Processes to start on a node when ``--nproc-per-node`` is not given.

    On a GPU node: one per visible GPU, as ``axolotl train`` and ``accelerate launch`` do, so that the
    GPUs beyond the context-parallel group train data-parallel (dp = GPUs / cp); a recipe that fixes
    its layout with ``dp_shard_size`` gets exactly that layout. Without GPUs: the recipe's layout
    (``dp_replicate_size × dp_shard_size × context_parallel_size × tensor_parallel_size``, 1 × 1 × cp × 1
    by default).

    Args:
        recipe: The validated recipe.
        gpu_count: GPUs this node shows (``torch.cuda.device_count()``, after ``CUDA_VISIBLE_DEVICES``).

    Raises:
        LaunchError: the visible GPUs cannot be split into whole CP groups.
    """
    if gpu_count <= 0 or recipe.dp_shard_size is not None:
        return recipe.default_process_count
    group = recipe.context_parallel_size * recipe.resolved_dp_replicate_size * recipe.tensor_parallel_size
    if gpu_count % group:
        tp = " × tensor_parallel_size" if recipe.tensor_parallel_size > 1 else ""
        raise LaunchError(
            f"{gpu_count} GPU(s) are visible, which cannot be split into groups of context_parallel_size × "
            f"dp_replicate_size{tp} = {group}: cptune starts one process per GPU. Give --nproc-per-node (a multiple "
            f"of {group}), or choose the GPUs with CUDA_VISIBLE_DEVICES."
        )
    return gpu_count


def visible_gpu_count() -> int:
    """CUDA GPUs this process may use (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_environment(plan: LaunchPlan, rank: int, port: int, base: dict[str, str]) -> dict[str, str]:
    """The environment torchrun would give local rank ``rank`` of a single-node run."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(plan.nproc_per_node),
        LOCAL_WORLD_SIZE=str(plan.nproc_per_node),
        GROUP_RANK="0",
        MASTER_ADDR=plan.master_addr or "127.0.0.1",
        MASTER_PORT=str(port),
        # As torchrun does: one thread per process unless the user said otherwise.
        OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"),
    )
    return env


def launch(plan: LaunchPlan, child_args: Sequence[str]) -> int:
    """Run ``python -m cptune <child_args>`` in every process of the plan; return the exit code."""
    if plan.multi_node:
        return _launch_torchrun(plan, child_args)
    return _launch_local(plan, child_args)


class _Terminated(Exception):
    """The launcher was sent SIGTERM."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into :class:`_Terminated` while the ranks run (only the main thread can)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _launch_local(plan: LaunchPlan, child_args: Sequence[str]) -> int:
    port = plan.master_port or free_port()
    command = [sys.executable, "-m", "cptune", *child_args]
    procs: list[subprocess.Popen] = []
    failed: tuple[int, int] | None = None
    try:
        with _sigterm_raises():
            for rank in range(plan.nproc_per_node):
                procs.append(
                    subprocess.Popen(command, env=child_environment(plan, rank, port, dict(os.environ)))
                )
            while True:
                codes = [p.poll() for p in procs]
                failures = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failures:
                    failed = failures[0]
                    break
                if all(c == 0 for c in codes):
                    return 0
                time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs, signal.SIGINT)
        return 130
    except _Terminated:
        signalled = _stop(procs, signal.SIGTERM)
        ended = "; ".join(
            f"rank {r} was sent {signalled[r]} (code {p.returncode})"
            if r in signalled
            else f"rank {r} had exited with code {p.returncode}{_signal_name(p.returncode or 0)}"
            for r, p in enumerate(procs)
        )
        print(f"cptune: the launcher was sent SIGTERM; stopped every rank: {ended}.", file=sys.stderr)
        return 128 + signal.SIGTERM
    rank, code = failed
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    signalled = _stop(procs, signal.SIGTERM)
    others = "; ".join(
        _how_it_ended(r, p.returncode, signalled.get(r)) for r, p in enumerate(procs) if r != rank
    )
    print(
        f"cptune: rank {rank} exited with code {code}{_signal_name(code)}; stopped the other ranks: {others}.",
        file=sys.stderr,
    )
    return code if code > 0 else 1


def _signal_name(code: int) -> str:
    """`` (SIGKILL)`` for a process ended by a signal (Popen reports it as a negative code)."""
    if code >= 0:
        return ""
    try:
        return f" ({signal.Signals(-code).name})"
    except ValueError:
        return ""


def _how_it_ended(rank: int, code: int | None, signalled: str | None) -> str:
    """How a rank other than the failing one ended, for the launcher's last line."""
    if signalled is not None:
        return f"rank {rank} did not exit on its own and was sent {signalled} (code {code})"
    return f"rank {rank} exited with code {code}{_signal_name(code or 0)}"


def _stop(procs: list[subprocess.Popen], sig: int) -> dict[int, str]:
    """Send ``sig`` to the processes still running, SIGKILL those that outlive GRACE_SECONDS.

    Returns:
        For each rank that had to be signalled, the last signal it was sent.
    """
    signalled: dict[int, str] = {}
    for rank, p in enumerate(procs):
        if p.poll() is None:
            p.send_signal(sig)
            signalled[rank] = signal.Signals(sig).name
    deadline = time.monotonic() + GRACE_SECONDS
    for rank, p in enumerate(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            signalled[rank] = "SIGKILL"
    return signalled


def _launch_torchrun(plan: LaunchPlan, child_args: Sequence[str]) -> int:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={plan.nproc_per_node}",
        f"--nnodes={plan.nnodes}",
        f"--node-rank={plan.node_rank}",
    ]
    optional = {
        "--master-addr": plan.master_addr,
        "--master-port": plan.master_port,
        "--rdzv-endpoint": plan.rdzv_endpoint,
        "--rdzv-backend": plan.rdzv_backend,
        "--rdzv-id": plan.rdzv_id,
    }
    command += [f"{flag}={value}" for flag, value in optional.items() if value is not None]
    command += ["-m", "cptune", *child_args]
    torchrun = subprocess.Popen(command)
    try:
        with _sigterm_raises():
            return _exit_code(torchrun.wait())
    except KeyboardInterrupt:
        # A terminal's Ctrl-C reaches torchrun too, and torchrun stops its workers; a SIGINT sent to
        # this process alone does not, so torchrun is told after the grace period.
        try:
            return _exit_code(torchrun.wait(timeout=GRACE_SECONDS))
        except subprocess.TimeoutExpired:
            torchrun.send_signal(signal.SIGTERM)
            return _exit_code(torchrun.wait())
    except _Terminated:
        # torchrun stops its workers when it is sent SIGTERM.
        torchrun.send_signal(signal.SIGTERM)
        return _exit_code(torchrun.wait())


def _exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it (128 + N for a child ended by signal N)."""
    return returncode if returncode >= 0 else 128 - returncode
