"""A cptune process that dies of a fatal signal prints every thread's Python stack before it dies.

A rank of a torch-backend run once died of SIGABRT ("malloc(): unaligned tcache chunk detected",
issue 26) with nothing in its output that named the Python code it was running, so the report could
not be traced. With :mod:`faulthandler` on from ``cptune``'s entry point the same crash prints the
stack of every thread, innermost frame first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

# A launched rank (the variables cptune's launcher and torchrun set) whose command aborts in
# native code while it runs: os.abort() raises SIGABRT as glibc does on a corrupted heap.
RANK_THAT_ABORTS = textwrap.dedent(
    """
    import os
    from cptune import cli

    def abort_in_native_code(*args, **kwargs):
        os.abort()

    cli._load = abort_in_native_code
    cli.main(["validate", "recipe.yaml"])
    """
)


@pytest.mark.e2e
def test_a_rank_killed_by_sigabrt_prints_the_python_stack_of_every_thread(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONFAULTHANDLER"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]),
        RANK="1",
        WORLD_SIZE="2",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
    )
    done = subprocess.run(
        [sys.executable, "-c", RANK_THAT_ABORTS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-3000:])
    assert "Fatal Python error: Aborted" in done.stderr, done.stderr[-3000:]
    stack = done.stderr[done.stderr.index("Fatal Python error: Aborted") :]
    # Innermost first: the function that aborted, then cptune's command and entry point.
    assert "Current thread" in stack
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith("File ")]
    assert frames[0].endswith("in abort_in_native_code"), frames
    assert any("cptune/cli.py" in frame and frame.endswith("in validate") for frame in frames), frames
    assert any("cptune/cli.py" in frame and frame.endswith("in main") for frame in frames), frames
