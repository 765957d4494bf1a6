"""``scripts/setup.sh``: what it says it installs is what it asks pip for, and it installs only what changed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

# A stand-in for .venv/bin/python: torch imports once pip installed it; pip records what it is
# asked for and succeeds; other code given with -c (the script's checks) succeeds.
FAKE_PYTHON = """#!/usr/bin/env bash
here=$(dirname "$0")
if [ "$1" = "-c" ]; then
  case "$2" in
    "import torch") [ -f "$here/torch-installed" ] ;;
    *hashlib*) shift 2; cat "$@" | sha256sum | cut -d" " -f1 ;;
    *) echo "fake: ok" ;;
  esac
  exit $?
fi
if [ "$1 $2 $3" = "-m pip install" ]; then
  shift 3; echo "$*" >> "$PIP_LOG"
  [ "$1" = "torch==2.13.0" ] && touch "$here/torch-installed"
  exit 0
fi
echo "fake python: unexpected $*" >&2; exit 3
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The files setup.sh reads, and a .venv whose python is the stand-in."""
    root = tmp_path / "checkout"
    for name in ("scripts/setup.sh", "pyproject.toml", "constraints/tested.txt"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, root / name)
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return root


def _setup(checkout: Path, *args: str) -> tuple[str, list[str]]:
    """Run setup.sh; returns its stdout and what it asked pip for."""
    pip_log = checkout / "pip.log"
    pip_log.unlink(missing_ok=True)
    done = subprocess.run(
        ["bash", str(checkout / "scripts" / "setup.sh"), *args],
        env={**os.environ, "PIP_LOG": str(pip_log)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, pip_log.read_text().splitlines() if pip_log.exists() else []


@pytest.mark.e2e
def test_setup_names_the_torch_it_asks_pip_for(checkout: Path):
    said, asked = _setup(checkout)
    assert asked[0] == "torch==2.13.0", asked
    line = next(line for line in said.splitlines() if "installing torch" in line)
    # Plain torch==2.13.0 is whatever build the index holds: the line must not promise the CPU one.
    assert line.startswith("cptune setup: installing torch==2.13.0 from the configured package index"), line
    assert "(CPU build)" not in line, line


@pytest.mark.e2e
def test_setup_installs_again_only_when_the_inputs_or_the_extras_change(checkout: Path):
    plain = "-c constraints/tested.txt -e .[test,quantization,wandb]"
    with_deepspeed = "-c constraints/tested.txt -e .[test,quantization,wandb,deepspeed]"
    assert _setup(checkout)[1] == ["torch==2.13.0", plain]
    said, asked = _setup(checkout)
    assert asked == [] and "nothing to install" in said, said
    assert _setup(checkout, "--deepspeed")[1] == [with_deepspeed]  # an extra not installed yet
    assert _setup(checkout)[1] == []  # fewer extras than installed
    with open(checkout / "constraints" / "tested.txt", "a") as constraints:
        constraints.write("# a changed pin\n")
    assert _setup(checkout)[1] == [plain]
