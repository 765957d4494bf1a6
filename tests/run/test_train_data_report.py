"""``cptune train`` says once where its data came from, and says it truly: prepared now, or from the cache."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import succeeded


def _data_lines(caplog) -> list[str]:
    said = [r.getMessage() for r in caplog.records]
    caplog.clear()
    return [line for line in said if line.startswith(("Preparing data into", "Data "))]


def test_train_reports_prepared_data_then_cached_data_once_each(write_recipe, cptune_in_process, caplog):
    recipe = write_recipe(max_steps=1)
    caplog.set_level(logging.INFO, logger="cptune")
    succeeded(cptune_in_process("train", str(recipe)))
    lines = _data_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("Preparing data into") and "(prepared in " in lines[1], lines

    succeeded(cptune_in_process("train", str(recipe), "--overwrite"))
    lines = _data_lines(caplog)
    assert len(lines) == 1 and "(loaded from cache)" in lines[0], lines


@pytest.mark.distributed
def test_a_launched_run_reports_its_freshly_prepared_data_once(quickstart_run):
    # The quickstart's launcher prepares the data (a fresh dataset_prepared_path); its two ranks load it.
    done, _ = quickstart_run
    succeeded(done)
    lines = [line for line in done.stderr.splitlines() if line.startswith(("Preparing data into", "Data "))]
    assert len(lines) == 2, done.stderr
    assert lines[0].startswith("Preparing data into") and "(prepared in " in lines[1], lines
    assert "loaded from cache" not in done.stderr
