"""The benchmark suite's smoke mode runs end to end, so the suite cannot rot.

It checks that every benchmark ran and that the page and results were written;
it asserts nothing about the numbers (performance claims live in the benchmark
results, never in timed assertions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from benchmarks.__main__ import MODULES

from tests.conftest import REPO


@pytest.mark.distributed
def test_smoke_suite_runs_every_benchmark_and_writes_the_page(tmp_path):
    # This checkout's cptune (src) before whichever one is installed, and the repository for benchmarks/.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "all", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    results = json.loads((tmp_path / "benchmarks" / "results.json").read_text())
    assert results["run"]["smoke"] is True
    for name in MODULES:
        section = results["sections"][name]
        assert "error" not in section, section.get("error")
        assert section["result"]
    page = (tmp_path / "benchmarks.md").read_text()
    for module in MODULES.values():
        assert f"## {module.TITLE}" in page
    assert "Smoke run" in page
    assert "## GPU script" in page
    for chart in ("memory.svg", "balance.svg"):
        svg = (tmp_path / "benchmarks" / chart).read_text()
        assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
        assert f"](benchmarks/{chart})" in page


@pytest.mark.e2e  # a fresh interpreter
def test_threads_preparing_data_keep_tqdms_lock():
    """The smoke suite's threads load data through datasets' thread_map at once: tqdm's lock must stay.

    In a fresh process (as the suite starts), ``ensure_lock`` deletes the class lock it created,
    under another thread's feet; after ``_preload`` it finds the lock and puts it back instead.
    """
    script = (
        "from tqdm.contrib.concurrent import ensure_lock\n"
        "from datasets.utils.tqdm import tqdm\n"
        "from benchmarks.__main__ import _preload\n"
        "with ensure_lock(tqdm):\n"
        "    pass\n"
        "assert not hasattr(tqdm, '_lock'), 'a fresh process was expected to lose the lock'\n"
        "_preload()\n"
        "with ensure_lock(tqdm):\n"
        "    pass\n"
        "assert hasattr(tqdm, '_lock'), 'ensure_lock deleted the lock after _preload'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
