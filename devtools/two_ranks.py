"""Two ranks of a devtools script on this machine, started with the environment cptune's launcher gives its ranks."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_two_ranks(
    command: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> list[int]:
    """Start ``command`` as ranks 0 and 1 of one gloo world (``env`` or this process's environment underneath);
    wait for both and return their exit codes."""
    from cptune.run.launch.processes import LaunchPlan, child_environment, free_port

    plan, port = LaunchPlan(nproc_per_node=2), free_port()
    base = dict(os.environ if env is None else env)
    procs = [
        subprocess.Popen(list(command), cwd=cwd, env=child_environment(plan, rank, port, base))
        for rank in range(plan.nproc_per_node)
    ]
    return [proc.wait() for proc in procs]
