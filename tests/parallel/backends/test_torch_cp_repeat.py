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
import subprocess
import sys

import pytest

from devtools.torch_cp_stress import ROW_LENGTHS
from tests.conftest import REPO


@pytest.mark.distributed
def test_repeated_ring_attention_steps_reproduce_every_bit():
    """Both of torch's rings (allgather and alltoall), in one launch."""
    iterations = len(ROW_LENGTHS)  # every row length once more after its reference step
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        # glibc checks every free and fills freed and fresh memory with a pattern, so that a
        # use after free reads garbage instead of the old numbers.
        "MALLOC_CHECK_": "3",
        "MALLOC_PERTURB_": "165",
    }
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
    assert done.returncode == 0, (reports, done.stderr[-3000:])
    assert sorted(report["rank"] for report in reports) == [0, 1]
    for report in reports:
        assert report["iterations"] == iterations and report["mismatches"] == 0, report
        assert sorted(report["strategies"]) == ["allgather", "alltoall"], report
