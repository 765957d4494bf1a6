"""The suite's split over pytest workers (tests/workers.py): a file's tests stay together, and so do the files
that share a session fixture that trains."""

from __future__ import annotations

from dataclasses import dataclass

from tests.workers import groups


@dataclass
class Item:
    nodeid: str
    fixturenames: tuple[str, ...] = ()


def test_each_file_is_a_group_and_files_sharing_a_training_fixture_join_one():
    items = [
        Item("tests/a.py::test_one"),
        Item("tests/a.py::test_two", ("tmp_path",)),
        Item("tests/b.py::test_one", ("one_process_runs",)),
        Item("tests/c.py::test_one"),
        Item("tests/c.py::test_two", ("one_process_runs", "quickstart_page_run")),
        Item("tests/d.py::test_one", ("quickstart_run", "quickstart_page_run")),
        Item("tests/e.py::test_one", ("tiny_model_dir",)),
    ]
    found = groups(items)
    assert found["tests/a.py::test_one"] == found["tests/a.py::test_two"] == "tests/a.py"
    # b and c share the reference runs, c and d the quickstart: one group, named after its first file.
    assert {found[i.nodeid] for i in items if i.nodeid[6] in "bcd"} == {"tests/b.py"}
    assert found["tests/e.py::test_one"] == "tests/e.py"
