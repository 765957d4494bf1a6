"""What every benchmark shares: settings, progress lines, statistics, spawning ranks, the machine.

Multi-process measurements start one Python process per rank with the
environment cptune's own launcher gives its ranks
(:func:`cptune.run.launch.processes.child_environment`: torchrun's variables and one
OpenMP thread per process), so a benchmark rank sees what a ``cptune train``
rank sees. Every rank writes ``rank{r}.json`` into its output folder.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_MODEL = REPO / "examples" / "tiny-llama"
EXAMPLE_DATA = REPO / "examples" / "data" / "quickstart.jsonl"
MiB = float(1 << 20)

# Quiet, offline, one thread per process: the same for every benchmark process.
_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONFAULTHANDLER": "1",  # a rank that dies of a signal prints its Python stack
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "PYTHONWARNINGS": "ignore",
}


class BenchmarkError(RuntimeError):
    """A benchmark process failed; the message carries the tail of its log."""


@dataclass
class Progress:
    """Progress lines on stderr: elapsed time since the suite started, benchmark, message."""

    started: float = field(default_factory=time.perf_counter)
    quiet: bool = False

    def __call__(self, benchmark: str, message: str) -> None:
        if self.quiet:
            return
        minutes, tenths = divmod(int((time.perf_counter() - self.started) * 10), 600)
        print(
            f"[{minutes:02d}:{tenths / 10:04.1f}] {benchmark}: {message}",
            file=sys.stderr,
            flush=True,
        )


@dataclass
class Settings:
    """How one suite run is sized and where it writes.

    Attributes:
        smoke: Toy sizes, one repeat: exercises every code path quickly.
        work_dir: Scratch folder for recipes, data, logs and model outputs.
        progress: Where progress lines go.
    """

    smoke: bool
    work_dir: Path
    progress: Progress

    def scratch(self, name: str) -> Path:
        path = self.work_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": median(values), "min": float(min(values)), "max": float(max(values)), "n": len(values)}


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark process: this one's, plus offline/threads settings and the repo on the path."""
    env = dict(os.environ)
    env.update(_WORKER_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def spawn_ranks(
    module: str,
    world_size: int,
    out_dir: Path,
    args: Sequence[str] = (),
    *,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``python -m module OUT_DIR ARGS`` as ``world_size`` ranks; return each rank's JSON report.

    A single rank runs without launcher variables, as ``cptune train`` runs a
    one-process recipe. Logs go to ``out_dir/rank{r}.log``.

    Raises:
        BenchmarkError: A rank failed or the run timed out (the logs' tails are in the message).
    """
    from cptune.run.launch.processes import LaunchPlan, child_environment

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("rank*.json"):
        stale.unlink()
    base = worker_env(env)
    plan, port = LaunchPlan(nproc_per_node=world_size), _unused_port()
    procs = []
    for rank in range(world_size):
        rank_env = child_environment(plan, rank, port, base) if world_size > 1 else base
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        command = [sys.executable, "-m", module, str(out_dir), *args]
        procs.append((subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        for proc, _ in procs:
            proc.kill()
            proc.wait()
    finally:
        for _, log in procs:
            log.close()
    codes = [proc.returncode for proc, _ in procs]
    if timed_out or any(codes):
        tails = "\n".join(
            f"--- rank {r} (exit {codes[r]}) ---\n{_tail(out_dir / f'rank{r}.log')}"
            for r in range(world_size)
        )
        what = f"timed out after {timeout:.0f} s" if timed_out else "failed"
        raise BenchmarkError(f"{module} with {world_size} rank(s) {what}:\n{tails}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


_PORTS_LOCK = threading.Lock()
_PORTS_GIVEN: set[int] = set()


def _unused_port() -> int:
    """A free port not yet handed to another launch of this process (launches may run in threads)."""
    from cptune.run.launch.processes import free_port

    with _PORTS_LOCK:
        while True:
            port = free_port()
            if port not in _PORTS_GIVEN:
                _PORTS_GIVEN.add(port)
                return port


def _tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    kept = [line for line in text.splitlines() if not line.startswith("USDT:")]
    return "\n".join(kept[-lines:])


def first_error_line(err: BaseException) -> str:
    """The most telling line of a failure: the last exception line of the first rank's log."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors[-1] if errors else lines[-1] if lines else type(err).__name__)[:300]


def write_rank_report(out_dir: str | Path, rank: int, report: dict[str, Any]) -> None:
    """Write a rank's report atomically (a reader never sees half a file)."""
    path = Path(out_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, OS, library versions, the commit and the load, for the results page."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    versions = {}
    for package in ("torch", "transformers", "accelerate", "peft", "datasets", "ring-flash-attn", "cptune"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "git": _git_state(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    changed = [line for line in git("status", "--porcelain").splitlines() if line.strip()]
    return {"commit": commit or None, "uncommitted_files": len(changed)}
