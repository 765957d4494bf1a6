"""Every bad input of the catalogue fails loud, early and harmlessly, through the real CLI.

For each case: exit code 2, exactly one ``error:`` message holding the
catalogue's fragment, no traceback, no model weights loaded and no process
started, and the workspace (recipe, data, an earlier data cache, an output
folder) byte-for-byte as it was. The cases run in-process through
``cptune.cli.main`` (the console script's entry point); those marked
``subprocess`` also run as ``python -m cptune`` to check the real stderr.
"""

from __future__ import annotations

import hashlib
import logging
import re
import stat
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cptune
from tests.reliability.catalogue import CASES, Case, Workspace, make_workspace

Snapshot = dict[str, tuple]


def snapshot(root: Path) -> Snapshot:
    """Every path under ``root`` with its kind, permissions, and for files size, mtime and content hash."""
    found: Snapshot = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        mode = stat.S_IMODE(info.st_mode)
        if path.is_dir():
            found[str(path.relative_to(root))] = ("dir", mode)
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path.relative_to(root))] = ("file", mode, info.st_size, info.st_mtime_ns, digest)
    return found


def is_cache_lock(name: str, entry: tuple) -> bool:
    """The data cache's empty lock file (cptune.data.cache.lock_path): coordination, not output.

    It is left on purpose: deleting a lock file other processes may wait on is unsafe.
    """
    parent, _, base = name.rpartition("/")
    return parent == "prepared" and base.startswith(".") and base.endswith(".lock") and entry[2] == 0


def assert_unchanged(before: Snapshot, after: Snapshot) -> None:
    created = {name for name in set(after) - set(before) if not is_cache_lock(name, after[name])}
    removed = set(before) - set(after)
    changed = {name for name in set(before) & set(after) if before[name] != after[name]}
    assert not (created or removed or changed), f"created {created}, removed {removed}, changed {changed}"


@pytest.fixture
def workspace(tmp_path: Path, tiny_model_dir: Path):
    ws = make_workspace(tmp_path / "ws", tiny_model_dir)
    yield ws
    for path in [ws.root, *ws.root.rglob("*")]:  # let pytest clean up read-only folders
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)


def point_log_handlers_at_stderr() -> None:
    """Make library log handlers write to the current (captured) stderr.

    Libraries (torch, datasets) keep a handler bound to the stderr of the test that first
    used them; pytest closes that stream when the test ends. Called in the test body, where
    ``sys.stderr`` is this test's capture.
    """
    for logger in [logging.root, *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]:
        for handler in logger.handlers:
            own_stream = "stream" in vars(handler)  # not lastResort, which looks sys.stderr up
            if own_stream and not type(handler).__module__.startswith("_pytest"):
                handler.stream = sys.stderr


@pytest.fixture
def fresh_logging():
    """Remove the root handler main() installs; it holds this test's captured stderr."""
    handlers = list(logging.root.handlers)
    yield
    logging.root.handlers[:] = handlers


@pytest.fixture
def no_heavy_work(monkeypatch, fresh_logging):
    """Fail the test if a model is loaded, training starts or processes are launched."""

    def refuse(what: str):
        def refused(*args, **kwargs):
            raise AssertionError(f"{what} before the bad input was refused")

        return refused

    # evaluate, inference and merge-lora import load_model by name: import them first, or a module first
    # imported here would keep the refusing stand-in for good (monkeypatch restores what it found: the stand-in).
    import cptune.run.commands.evaluate
    import cptune.run.commands.merge  # noqa: F401

    monkeypatch.setattr("cptune.models.loading.load_model", refuse("model weights were loaded"))
    monkeypatch.setattr("cptune.run.commands.weights.load_model", refuse("model weights were loaded"))
    monkeypatch.setattr("cptune.run.commands.merge.load_model", refuse("model weights were loaded"))
    monkeypatch.setattr("cptune.run.training.train.train", refuse("training started"))
    monkeypatch.setattr("cptune.run.commands.evaluate.evaluate", refuse("evaluation started"))
    monkeypatch.setattr("cptune.run.launch.processes.launch", refuse("processes were launched"))


def prepare(case: Case, ws: Workspace) -> list[str]:
    reason = case.skip_if() if case.skip_if is not None else None
    if reason is not None:
        pytest.skip(reason)
    case.write_recipe(ws)
    return case.argv(ws)


def assert_one_clear_error(code: int | None, stderr: str, case: Case) -> None:
    assert code == 2, f"exit code {code}"  # CptuneError.exit_code, as docs/troubleshooting.md says
    assert "Traceback" not in stderr, stderr
    assert case.fragment in stderr, f"{case.fragment!r} not in:\n{stderr}"
    assert len(re.findall(r"^(\[rank \d+\] )?error: ", stderr, flags=re.MULTILINE)) == 1, stderr


def test_catalogue_ids_are_unique_and_the_catalogue_is_large():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids))
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_bad_input_fails_loud_early_and_harmlessly(case: Case, workspace: Workspace, no_heavy_work, capsys):
    from cptune.cli import main

    argv = prepare(case, workspace)
    before = snapshot(workspace.root)
    capsys.readouterr()
    point_log_handlers_at_stderr()
    with pytest.raises(SystemExit) as exited:
        main(argv)
    stderr = capsys.readouterr().err
    assert_one_clear_error(exited.value.code, stderr, case)
    assert_unchanged(before, snapshot(workspace.root))


@pytest.mark.e2e
@pytest.mark.parametrize("case", [c for c in CASES if c.subprocess], ids=lambda case: case.id)
def test_bad_input_through_the_console_entry_point(case: Case, workspace: Workspace):
    argv = prepare(case, workspace)
    before = snapshot(workspace.root)
    done = run_cptune(*argv, cwd=workspace.root, timeout=120)
    assert_one_clear_error(done.returncode, done.stderr, case)
    assert not done.stdout.strip(), done.stdout
    assert_unchanged(before, snapshot(workspace.root))
