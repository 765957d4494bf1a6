"""The tiers (tests/tiers.py): which tests plain ``pytest`` runs, and the guard against unmarked processes.

Each test runs a small suite through pytest in this process (``pytester``) with the suite's hooks.
"""

from __future__ import annotations

import pytest

CONFTEST = """
from tests import tiers
from tests.tiers import (
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
)


def pytest_configure(config):
    tiers.install_guard()
"""

INI = """
[pytest]
testpaths = suite
markers =
    distributed: several processes
    e2e: one process
    slow: slow
"""

SPAWNING = """
import multiprocessing
import os
import subprocess
import sys

import pytest


def start_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_subprocess():
    start_python()


def test_unmarked_subprocess_whose_refusal_is_swallowed():
    try:
        start_python()
    except Exception:
        pass


def test_unmarked_multiprocessing_spawn():
    process = multiprocessing.get_context("spawn").Process(target=print)
    process.start()
    process.join()


def test_unmarked_os_system():
    os.system("true")


@pytest.fixture
def started_in_a_fixture():
    start_python()


def test_unmarked_with_a_fixture_that_starts_a_process(started_in_a_fixture):
    pass


@pytest.mark.distributed
def test_marked_distributed():
    start_python()


@pytest.mark.e2e
def test_marked_e2e():
    start_python()


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.e2e)])
def test_marked_through_its_parameter(n):
    start_python()


def test_unmarked_without_processes():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    return pytester


def test_an_unmarked_test_that_starts_a_process_fails_and_a_marked_one_passes(suite: pytest.Pytester):
    suite.mkpydir("suite").joinpath("test_spawning.py").write_text(SPAWNING)
    result = suite.runpytest_inprocess("suite", "-p", "no:cacheprovider")
    outcomes = {
        report.nodeid.rsplit("::", 1)[1]: report.outcome
        for report in result.reprec.getreports("pytest_runtest_logreport")
        if report.when == "call" or report.failed
    }
    assert outcomes == {
        "test_unmarked_subprocess": "failed",
        "test_unmarked_subprocess_whose_refusal_is_swallowed": "failed",
        "test_unmarked_multiprocessing_spawn": "failed",
        "test_unmarked_os_system": "failed",
        "test_unmarked_with_a_fixture_that_starts_a_process": "failed",
        "test_marked_distributed": "passed",
        "test_marked_e2e": "passed",
        "test_marked_through_its_parameter[1]": "passed",
        "test_unmarked_without_processes": "passed",
    }
    result.stdout.fnmatch_lines(
        [
            "*suite/test_spawning.py::test_unmarked_subprocess starts a process (*python -c pass) but "
            "carries neither marker distributed nor e2e: mark it @pytest.mark.distributed if it starts "
            "several processes, @pytest.mark.e2e if it starts one*",
        ]
    )


SELECTION = """
import pytest


def test_unit():
    pass


@pytest.mark.distributed
def test_ranks():
    pass


@pytest.mark.e2e
def test_cli():
    pass


@pytest.mark.slow
def test_slow():
    pass
"""


@pytest.mark.parametrize(
    ("args", "ran", "deselected"),
    [
        ((), {"test_unit"}, 3),
        (("-k", "test_ranks or test_unit"), {"test_unit"}, 3),
        (("--full",), {"test_unit", "test_ranks", "test_cli", "test_slow"}, 0),
        (("-m", "distributed"), {"test_ranks"}, 3),
        (("-m", "e2e or slow"), {"test_cli", "test_slow"}, 2),
        (("suite",), {"test_unit", "test_ranks", "test_cli", "test_slow"}, 0),
        (("suite/test_selection.py::test_ranks",), {"test_ranks"}, 0),
    ],
    ids=[
        "no-arguments",
        "k-filters-the-fast-tier",
        "full",
        "m-distributed",
        "m-expression",
        "path",
        "test-id",
    ],
)
def test_plain_pytest_runs_the_fast_tier_and_anything_named_runs_whole(
    suite: pytest.Pytester, args: tuple[str, ...], ran: set[str], deselected: int
):
    suite.mkpydir("suite").joinpath("test_selection.py").write_text(SELECTION)
    result = suite.runpytest_inprocess(*args, "-p", "no:cacheprovider")
    passed, _, failed = result.reprec.listoutcomes()
    assert not failed
    assert {report.nodeid.rsplit("::", 1)[1] for report in passed} == ran
    result.assert_outcomes(passed=len(ran), deselected=deselected)
