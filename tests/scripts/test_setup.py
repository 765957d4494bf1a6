"""``scripts/setup.sh``: what it says it installs is what it asks pip for."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

# A stand-in for .venv/bin/python: torch is missing, pip records what it is asked for and succeeds.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then
  case "$2" in "import torch") exit 1 ;; *) echo "fake: ok"; exit 0 ;; esac
fi
if [ "$1 $2 $3" = "-m pip install" ]; then shift 3; echo "$*" >> "$PIP_LOG"; exit 0; fi
echo "fake python: unexpected $*" >&2; exit 3
"""


@pytest.mark.e2e
def test_setup_names_the_torch_it_asks_pip_for(tmp_path: Path):
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", checkout / "scripts" / "setup.sh")
    bin_dir = checkout / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    pip_log = tmp_path / "pip.log"
    done = subprocess.run(
        ["bash", str(checkout / "scripts" / "setup.sh")],
        env={**os.environ, "PIP_LOG": str(pip_log)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    asked = pip_log.read_text().splitlines()
    assert asked[0] == "torch==2.13.0", asked
    said = next(line for line in done.stdout.splitlines() if "installing torch" in line)
    # Plain torch==2.13.0 is whatever build the index holds: the line must not promise the CPU one.
    assert said.startswith("cptune setup: installing torch==2.13.0 from the configured package index"), said
    assert "(CPU build)" not in said, said
