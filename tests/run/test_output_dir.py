"""An earlier run in output_dir is refused, resumed, or overwritten on request; never replaced by mistake."""

from __future__ import annotations

import logging

import pytest

from cptune.config.loader import load_recipe
from cptune.errors import CptuneError
from cptune.run.training.checkpoints import STAGING_DIR, write_marker
from cptune.run.training.output_dir import check_earlier_run, clear_earlier_run, earlier_run


def finished_run(out):
    out.mkdir(parents=True, exist_ok=True)
    (out / "notes.txt").write_text("mine")
    (out / "adapter_model.safetensors").write_bytes(b"weights")
    (out / "train_log.json").write_text("[]")
    checkpoint = out / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    write_marker(checkpoint, 2)
    (out / "checkpoint-3").mkdir()  # a save that was interrupted
    (out / STAGING_DIR).mkdir()


def test_what_counts_as_an_earlier_run(tmp_path):
    out = tmp_path / "out"
    assert earlier_run(out) == []
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "checkpoint-3").mkdir()
    assert earlier_run(out) == []  # neither a model, a log, nor a complete checkpoint
    finished_run(tmp_path / "done")
    assert earlier_run(tmp_path / "done") == ["adapter_model.safetensors", "train_log.json", "checkpoint-2"]


def test_resume_or_overwrite_lets_a_run_start_in_an_earlier_runs_folder(write_recipe, tmp_path):
    finished_run(tmp_path / "out")
    with pytest.raises(CptuneError, match="already holds an earlier run"):
        check_earlier_run(load_recipe(write_recipe()))
    check_earlier_run(load_recipe(write_recipe(resume_from_checkpoint=True)))
    check_earlier_run(load_recipe(write_recipe(overwrite_output_dir=True)))


def test_overwrite_removes_the_earlier_checkpoints_and_log_only(write_recipe, tmp_path, caplog):
    out = tmp_path / "out"
    finished_run(out)
    assert clear_earlier_run(load_recipe(write_recipe())) == []
    with caplog.at_level(logging.INFO, logger="cptune"):
        clear_earlier_run(load_recipe(write_recipe(overwrite_output_dir=True)))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_model.safetensors", "notes.txt"]
    assert "removed the earlier run's checkpoint-2, checkpoint-3" in caplog.text


def test_overwrite_flag_reaches_training(write_recipe, tmp_path, monkeypatch):
    """``cptune train --overwrite`` passes the preflight that refuses without it, and trains with the key set."""
    from cptune.cli import main

    finished_run(tmp_path / "out")
    seen = []
    monkeypatch.setattr(
        "cptune.run.training.train.train", lambda recipe, plan=None, **_: seen.append(recipe) or _Done(recipe)
    )
    handlers = list(logging.root.handlers)
    try:
        main(["train", str(write_recipe()), "--overwrite"])  # returns: exit code 0
    finally:
        logging.root.handlers[:] = handlers  # main() installs a handler on this test's stderr
    assert seen and seen[0].overwrite_output_dir
    assert (tmp_path / "out" / "train_log.json").exists()  # removed by train() itself, not by preflight


class _Done:
    def __init__(self, recipe):
        self.seconds, self.output_dir = 0.0, recipe.output_dir
