"""Fixtures of the end-to-end runs' tests."""

from __future__ import annotations

import pytest

from tests.run.one_process import OneProcessRuns, wanted_by


@pytest.fixture(scope="session")
def one_process_runs(request, tmp_path_factory, tiny_model_dir) -> OneProcessRuns:
    """The cp=1 reference runs registered with tests.run.one_process.one_process_reference, in one process:
    those of every selected test that compares with them, trained when the first of these tests asks."""
    wanted = wanted_by(request.session.items)
    return OneProcessRuns(tmp_path_factory.mktemp("one-process"), tiny_model_dir, wanted)
