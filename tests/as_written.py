"""Run a documented command as a reader types it: ``bash -c COMMAND`` in a fresh copy of what a clone holds.

Shared by the check that every page's commands run (tests/docs/test_commands.py) and the session's
quickstart run (tests/conftest.py ``quickstart_page_run``), which is the getting-started page's own
training command, run once for both.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def page_environment() -> dict[str, str]:
    """This test run's environment with its interpreter's ``cptune``, ``accelerate`` and ``torchrun``
    first on PATH and this checkout's source first on PYTHONPATH; one torch thread per process."""
    python_path = os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": python_path.rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1",
    }


def fresh_clone(root: Path) -> Path:
    """``root/clone`` holding a copy of ``examples/``, as a clone of the repository does."""
    folder = root / "clone"
    shutil.copytree(REPO / "examples", folder / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def run_as_written(command: str, folder: Path) -> subprocess.CompletedProcess:
    """``command`` through bash in ``folder``, stdout and stderr in a pipe (as in a log file), no stdin."""
    return subprocess.run(
        ["bash", "-c", command],
        cwd=folder,
        env=page_environment(),
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
