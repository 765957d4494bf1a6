"""Run a Python script in several gloo processes and collect what each rank reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cptune.run.launch.processes import LaunchPlan, child_environment, free_port

# ``python -c`` this, SCRIPT, ARGS runs ``python SCRIPT ARGS`` (the same sys.argv, sys.path[0] the script's
# folder, run as __main__) with bitsandbytes left out first, as cptune.run.training.unused_imports does.
_WITHOUT_BITSANDBYTES = (
    "import os, runpy, sys; sys.modules['bitsandbytes'] = None; sys.argv = sys.argv[1:]; "
    "sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0])); runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run_ranks(
    script: Path, world_size: int, out_dir: Path, *args: str, timeout: float = 240, bitsandbytes: bool = True
) -> list[dict]:
    """Start ``world_size`` processes of ``script``; each writes ``out_dir/rank{r}.json``.

    ``bitsandbytes=False`` where nothing the ranks run quantizes or uses its optimizers: each rank
    starts with it left out, as a rank of ``cptune train`` whose recipe does not use it
    (:mod:`cptune.run.training.unused_imports`; about a second less start-up per rank).

    Fails with every rank's output when a process exits non-zero or times out.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    plan = LaunchPlan(nproc_per_node=world_size)
    base = dict(os.environ)
    repo = Path(__file__).resolve().parents[1]  # src for cptune, the root for devtools (tiny models)
    base["PYTHONPATH"] = os.pathsep.join([str(repo / "src"), str(repo), base.get("PYTHONPATH", "")])
    start = [] if bitsandbytes else ["-c", _WITHOUT_BITSANDBYTES]
    procs = []
    for rank in range(world_size):
        env = child_environment(plan, rank, port, base)
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, *start, str(script), str(out_dir), *args],
                    env=env,
                    stdout=log,
                    stderr=log,
                ),
                log,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc, _ in procs:
            proc.kill()
    finally:
        for _, log in procs:
            log.close()
    codes = [proc.returncode for proc, _ in procs]
    if any(code != 0 for code in codes):
        logs = "\n".join(
            f"--- rank {r} (exit {codes[r]}) ---\n{(out_dir / f'rank{r}.log').read_text()[-4000:]}"
            for r in range(world_size)
        )
        raise AssertionError(f"distributed run failed:\n{logs}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
