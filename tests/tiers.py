"""The suite's tiers, and the guard that keeps every test in the right one.

Two markers name what makes a test slow on a CPU:

- ``distributed``: the test starts several processes (gloo ranks, the launcher, torchrun,
  multiprocessing workers);
- ``e2e``: the test starts one process: a ``cptune`` command run as a user runs it
  (``python -m cptune ...``) or another fresh Python interpreter.

``pytest`` with no arguments runs the fast tier: it deselects ``distributed``, ``e2e`` and
``slow``. Anything named on the command line runs whole: a path or a test id, a ``-m``
expression (``pytest -m distributed``), or ``--full``, which ``scripts/test.sh`` (the README's
test command, and CI) passes so that it runs everything.

The guard: a test that starts a process, of any kind, during its setup, call or teardown
without carrying ``distributed`` or ``e2e`` fails, and the process is not started. There is no
allowance for "cheap" processes: the markers are what keeps the fast tier fast and honest, and
one rule needs no judgement. The guard sees ``subprocess`` (and what is built on it: ``os.popen``,
``ctypes.util.find_library``), ``os.fork``/``os.system``/``os.posix_spawn``/``os.spawn*``
through Python's audit events, and ``multiprocessing`` (``torch.multiprocessing.spawn``,
process pools) through ``BaseProcess.start``, whose spawn and forkserver starts raise no event.
"""

from __future__ import annotations

import multiprocessing.process
import sys
from collections.abc import Iterator
from typing import Any

import pytest

SPAWN_MARKERS = ("distributed", "e2e")
"""A test that starts a process carries one of these."""

FAST_TIER_EXCLUDES = (*SPAWN_MARKERS, "slow")
"""What ``pytest`` with no arguments leaves out."""

_SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.spawn"}
)
_spawns_key = pytest.StashKey[list[str]]()


class UnmarkedSpawnError(RuntimeError):
    """Raised where a test without ``distributed`` or ``e2e`` starts a process."""


# The test whose phases are running and is refused processes; None between tests (collection,
# session start and end) and while a marked test runs. A stack, so that a test running pytest
# in this process (tests/test_tiers.py) hands the decision to the inner test and gets it back.
_refused: list[pytest.Item | None] = [None]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="run every tier, distributed, e2e and slow tests included (scripts/test.sh passes it)",
    )


def install_guard() -> None:
    """Start refusing processes to unmarked tests (once per interpreter; audit hooks stay)."""
    if getattr(install_guard, "installed", False):
        return
    sys.addaudithook(_on_audit_event)
    start = multiprocessing.process.BaseProcess.start

    def guarded_start(process: multiprocessing.process.BaseProcess) -> None:
        _refuse_if_unmarked(f"multiprocessing process {process.name} (target {process._target!r})")
        start(process)

    multiprocessing.process.BaseProcess.start = guarded_start  # type: ignore[method-assign]
    install_guard.installed = True  # type: ignore[attr-defined]


def _on_audit_event(event: str, args: tuple[Any, ...]) -> None:
    if event in _SPAWN_EVENTS and _refused[-1] is not None:
        _refuse_if_unmarked(_describe(event, args))


def _describe(event: str, args: tuple[Any, ...]) -> str:
    if event == "subprocess.Popen":
        argv = args[1]
        shown = argv if isinstance(argv, str | bytes) else " ".join(map(str, argv))
        return f"a process ({shown[:200]})"
    return f"a process ({event})"


def _refuse_if_unmarked(what: str) -> None:
    item = _refused[-1]
    if item is None:
        return
    message = (
        f"{item.nodeid} starts {what} but carries neither marker {' nor '.join(SPAWN_MARKERS)}: "
        "mark it @pytest.mark.distributed if it starts several processes, @pytest.mark.e2e if it "
        "starts one (a cptune command, a fresh interpreter); see tests/tiers.py"
    )
    item.stash.setdefault(_spawns_key, []).append(message)
    raise UnmarkedSpawnError(message)


def carries_spawn_marker(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in SPAWN_MARKERS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _refused.append(None if carries_spawn_marker(item) else item)
    try:
        return (yield)
    finally:
        _refused.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    # Code under test may swallow the refusal (a broad ``except``); the test fails all the same.
    report = yield
    refused = item.stash.get(_spawns_key, [])
    if refused and report.passed:
        report.outcome = "failed"
        report.longrepr = "\n".join(refused)
    item.stash[_spawns_key] = []
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``pytest`` with no arguments: leave out the tiers that start processes, and slow tests."""
    named = config.args_source is not pytest.Config.ArgsSource.TESTPATHS
    if config.getoption("full") or config.getoption("markexpr") or named:
        return
    fast, left_out = [], []
    for item in items:
        excluded = any(item.get_closest_marker(name) for name in FAST_TIER_EXCLUDES)
        (left_out if excluded else fast).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = fast
