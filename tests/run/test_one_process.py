"""The session's one process of cp=1 references (tests/run/one_process.py), its launches recorded, not run."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.collective_audit import VARIABLE as AUDIT_VARIABLE
from tests.run import one_process
from tests.run.one_process import OneProcessRuns, one_process_reference, wanted_by
from tests.run.train_worker import RUN_ENDS, RUN_STARTS


@pytest.fixture
def launches(monkeypatch) -> list[dict]:
    """Two registered references, and the launches ``run_ranks`` is asked for (none runs)."""
    monkeypatch.setattr(one_process, "REFERENCES", {})
    for name in ("a", "b"):

        @one_process_reference(name, f"test_{name}", f"fixture_{name}")
        def write(folder: Path, tiny_model_dir: Path, name=name) -> list[Path]:
            (folder / "recipe.yaml").write_text(name)
            return [folder / "recipe.yaml"]

    asked: list[dict] = []

    def run_ranks(worker, world_size, launch, *recipes, timeout):
        asked.append({"world_size": world_size, "recipes": recipes, "audit": os.environ.get(AUDIT_VARIABLE)})
        # The worker's log: each run's part between its marks, the process's own lines around them.
        parts = [
            f"{RUN_STARTS.format(recipe=recipe)}\ntrained {Path(recipe).read_text()}\n{RUN_ENDS.format(recipe=recipe)}\n"
            for recipe in recipes
        ]
        launch.mkdir()
        (launch / "rank0.log").write_text("".join(["starting\n", *parts, "closing process groups\n"]))

    monkeypatch.setattr(one_process, "run_ranks", run_ranks)
    monkeypatch.setenv(AUDIT_VARIABLE, "audit-of-the-test-that-asks")
    return asked


def test_the_selected_tests_references_train_in_one_launch_outside_the_audit(launches, tmp_path):
    items = [SimpleNamespace(name="test_a[1]", originalname="test_a"), SimpleNamespace(name="test_c")]
    items.append(SimpleNamespace(name="test_d", fixturenames=["fixture_b"]))
    assert wanted_by(items) == {"a", "b"}
    assert wanted_by(items[1:2]) == set()  # -k: the references of tests not selected do not train

    runs = OneProcessRuns(tmp_path, tmp_path / "tiny", {"a", "b"})
    assert runs["b"] == tmp_path / "b" and runs["a"] == tmp_path / "a"
    recipes = [str(tmp_path / name / "recipe.yaml") for name in ("a", "b")]
    assert launches == [{"world_size": 1, "recipes": tuple(recipes), "audit": None}]


def test_a_references_log_is_what_its_own_runs_logged_not_the_whole_launchs(launches, tmp_path):
    # A test looking for a line its run logs must not find another run's line of the shared launch.
    runs = OneProcessRuns(tmp_path, tmp_path / "tiny", {"a", "b"})
    assert runs.log("b") == "trained b\n" and runs.log("a") == "trained a\n"
    assert runs.run_logs("a") == {tmp_path / "a" / "recipe.yaml": "trained a\n"}
    assert len(launches) == 1


def test_a_failed_launch_fails_every_later_test_that_asks_with_a_pointer_to_it(
    launches, tmp_path, monkeypatch
):
    def failing(*args, **kwargs):
        raise RuntimeError("rank 0 exited with 1")

    monkeypatch.setattr(one_process, "run_ranks", failing)
    runs = OneProcessRuns(tmp_path, tmp_path / "tiny", {"a", "b"})
    with pytest.raises(RuntimeError, match="rank 0 exited"):
        runs["a"]  # the first test that asks sees the launch's own error
    for name in ("a", "b"):  # not a FileExistsError of a second launch into the same folders
        with pytest.raises(pytest.fail.Exception, match=rf"'{name}' failed: .*launch-1.rank0\.log"):
            runs[name]


def test_references_asked_for_by_a_test_their_registration_does_not_name_are_refused(launches, tmp_path):
    runs = OneProcessRuns(tmp_path, tmp_path / "tiny", {"a"})  # the test asking for b is not in needed_by
    with pytest.raises(pytest.fail.Exception, match=r"'b'.*needed_by: \('test_b', 'fixture_b'\)"):
        runs["b"]
    assert launches == []
