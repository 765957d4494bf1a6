"""How the whole suite shares a machine's cores: pytest-xdist workers, each group of tests on one of them.

``scripts/test.sh`` runs the suite in two pytest workers (``--numprocesses 2 --dist loadgroup``). One
process alone left a core idle about a third of the time on a 2-core machine (measured: 27
CPU-minutes in 18.7 minutes): a launcher preparing data, a rank waiting for the others, an
in-process test's single thread. A second worker fills those gaps.

What the tests share decides which worker runs them. A test file's module-scoped fixtures (its rank
launches: tests/parallel/test_parity.py's, tests/run/test_train_fsdp.py's) are made once per worker
that runs the file, so every test of a file goes to the same worker: its group is its file. The
session's fixtures that train (:data:`SHARED_FIXTURES`) would be made once per worker too, so every
file whose tests use one of them joins one group with the other files that use it. Cheap session
fixtures (the tiny model, the tokenizers) are made in each worker.

The groups need each test's fixtures, which only the workers know (they collect); the controller,
which hands out the tests, knows their ids. So each worker writes ``{test id: group}`` into a file the
controller names (:func:`pytest_configure_node`), and the controller's scheduler
(:class:`GroupScheduling`, through xdist's ``pytest_xdist_make_scheduler``) reads it. xdist's own
``loadgroup`` reads ``xdist_group`` marks by renaming each test's id, which pytest 9.2's ids no longer
allow (xdist 3.8 renames an attribute pytest stopped reading): this takes its place.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

SHARED_FIXTURES = ("quickstart_page_run", "one_process_runs")
"""Session fixtures that train (the quickstart as the docs run it; the cp=1 reference runs of several
modules, tests/run/one_process.py): the files whose tests use one run on one worker."""

GROUPS_OPTION = "cptune_groups"
"""The worker input that names the file of groups."""

_groups_file = pytest.StashKey[Path]()


def groups(items: list[Any]) -> dict[str, str]:
    """``{nodeid: group}``: a test's file, or the first (sorted) of the files linked to it through a shared
    fixture, directly or through other files."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def join(a: str, b: str) -> None:
        first, second = sorted((root(a), root(b)))
        parent[second] = first

    files = {item.nodeid: item.nodeid.split("::")[0] for item in items}
    for item in items:
        root(files[item.nodeid])
        for fixture in SHARED_FIXTURES:
            if fixture in getattr(item, "fixturenames", ()):
                join(files[item.nodeid], f"~{fixture}")  # "~" sorts after every file path
    return {nodeid: root(file) for nodeid, file in files.items()}


def _distributes_by_group(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadgroup"


def pytest_configure(config: pytest.Config) -> None:
    if _distributes_by_group(config) and not hasattr(config, "workerinput"):  # the controller
        handle, name = tempfile.mkstemp(prefix="cptune-test-groups-", suffix=".json")
        os.close(handle)
        config.stash[_groups_file] = Path(name)


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_groups_file, None)
    if path is not None:
        path.unlink(missing_ok=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    path = node.config.stash.get(_groups_file, None)
    if path is not None:
        node.workerinput[GROUPS_OPTION] = str(path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = getattr(config, "workerinput", {}).get(GROUPS_OPTION)
    if path is None:
        return
    # Every worker collects the same tests and writes the same groups; the rename makes each write whole.
    written = Path(f"{path}.{os.getpid()}")
    written.write_text(json.dumps(groups(items)))
    written.replace(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    path = config.stash.get(_groups_file, None)
    if path is None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scheduling by scope, a test's scope being its group (read once the workers collected)."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self._groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # the workers wrote it before they reported their collection
                self._groups = json.loads(path.read_text() or "{}")
            if nodeid not in self._groups:  # a broken handshake would split the shared fixtures silently
                raise RuntimeError(f"tests/workers.py: no group for {nodeid} in {path}")
            return self._groups[nodeid]

    return GroupScheduling(config, log)
