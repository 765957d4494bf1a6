"""cp_backend: torch on CPU gives the same bits every time it attends to the same rows (issue 26).

A rank of a torch-backend run once aborted with a corrupted heap; a buffer of torch's ring (K/V or
their gradients in flight over gloo) freed or rewritten while a gloo thread still used it would also
change numbers silently before it crashed anything. The ring, cptune's CPU handlers and the patched
dispatch are deterministic, so repeating one step on the same rows must reproduce its output and
gradients bit for bit, with the heap churned in between and glibc's own checks on
(:mod:`devtools.torch_cp_stress`, which runs it longer).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from devtools.heap_checks import heap_checks
from devtools.torch_cp_stress import ROW_LENGTHS
from tests.conftest import REPO

# Where a dying process starts to say why: Python's fatal error (faulthandler's dump follows), the C++
# runtime's terminate, glibc's heap checks.
CRASH_START = re.compile(r"Fatal Python error|terminate called|malloc\(\)|free\(\)|double free|corrupted")


def crash_excerpts(stderr: str, width: int = 1500) -> str:
    """What a failed launch's ranks said as they died (the two ranks share stderr), then its last lines."""
    starts = [found.start() for found in CRASH_START.finditer(stderr)]
    return "\n[...]\n".join([*(stderr[start : start + width] for start in starts[:4]), stderr[-width:]])


@pytest.mark.distributed
def test_repeated_ring_attention_steps_reproduce_every_bit():
    """Both of torch's rings (allgather and alltoall), in one launch."""
    iterations = len(ROW_LENGTHS)  # every row length once more after its reference step
    # glibc checks every free and fills freed and fresh memory with a pattern, so that a use after free
    # reads garbage instead of the old numbers (where the checks can't be on, the pattern still is).
    env, _ = heap_checks(
        {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "devtools.torch_cp_stress",
            f"--iterations={iterations}",
            "--strategy=allgather",
            "--strategy=alltoall",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, (reports, crash_excerpts(done.stderr))
    assert sorted(report["rank"] for report in reports) == [0, 1]
    for report in reports:
        assert report["iterations"] == iterations and report["mismatches"] == 0, report
        assert sorted(report["strategies"]) == ["allgather", "alltoall"], report


OVERRUN = """
import ctypes
block = bytearray(20)  # 21 bytes (its trailing NUL), from malloc under PYTHONMALLOC=malloc
view = (ctypes.c_char * 20).from_buffer(block)
address = ctypes.addressof(view)
del view
ctypes.memset(address + 21, 1, 1)  # one byte past the block, inside its chunk's slack
del block
print("freed")
"""


@pytest.mark.e2e
def test_the_heap_checks_catch_a_one_byte_overrun():
    """With the environment :func:`heap_checks` gives, glibc aborts a process that wrote one byte past a block
    when it frees it. With MALLOC_CHECK_=3 alone (no libc_malloc_debug.so preloaded), glibc 2.36 frees it
    silently. The block is CPython's own, as torch's are: their calls bind the versioned symbols that the
    preloaded library interposes, where a ``ctypes`` call to ``malloc`` would get libc's default one."""
    env, off = heap_checks({**os.environ, "PYTHONMALLOC": "malloc"})
    if off is not None:
        pytest.skip(f"glibc's heap checks are not available here: {off}")
    done = subprocess.run(
        [sys.executable, "-c", OVERRUN], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stdout, done.stderr)
    assert "freed" not in done.stdout
