"""A run keeps its resolved recipe; ``--resume`` refuses a recipe that changes how that run is shaped."""

from __future__ import annotations

import logging

import pytest
import yaml

from cptune.config.loader import load_recipe
from cptune.errors import CptuneError
from cptune.run.training.run_recipe import RUN_RECIPE_NAME, check_resumed_recipe, save_run_recipe
from tests.conftest import succeeded
from tests.run.test_cli_errors import assert_clean_failure


def test_the_saved_recipe_holds_the_overrides_and_a_resume_is_checked_against_it(write_recipe, tmp_path):
    path = write_recipe()
    started = load_recipe(path, ["--max_steps=6", "--learning_rate=0.01", "--save_steps=2"])
    saved = save_run_recipe(started)
    assert saved == tmp_path / "out" / RUN_RECIPE_NAME
    assert yaml.safe_load(saved.read_text()) == started.model_dump(mode="json")
    checkpoint = tmp_path / "out" / "checkpoint-2"

    # The same run, with a change that does not shape it (logging): continues, and says what changed.
    assert check_resumed_recipe(
        load_recipe(path, ["--max_steps=6", "--learning_rate=0.01", "--logging_steps=3"]), checkpoint
    ) == ["logging_steps: 1 -> 3", "save_steps: 2 -> unset"]
    # Not resuming: nothing to check.
    assert check_resumed_recipe(load_recipe(path), None) == []

    with pytest.raises(CptuneError) as refused:
        check_resumed_recipe(load_recipe(path, ["--resume_from_checkpoint=true"]), checkpoint)
    message = str(refused.value)
    assert "change 2 settings of the run in" in message, message
    assert "  - max_steps: 6 in the run, 4 now" in message, message
    assert "  - learning_rate: 0.01 in the run, 0.002 now" in message, message
    assert "save_steps" not in message.split("would continue")[1].split("Resume with")[0], message
    assert str(saved) in message

    # A resume that keeps the run's file, and a run saved by an older cptune (no file): nothing to compare.
    assert save_run_recipe(load_recipe(path, ["--resume_from_checkpoint=true"])) is None
    saved.unlink()
    check_resumed_recipe(load_recipe(path), checkpoint)


def test_train_resume_with_other_steps_and_batch_is_refused_before_any_work(
    write_recipe, cptune_in_process, tmp_path, caplog
):
    recipe = write_recipe()
    caplog.set_level(logging.INFO, logger="cptune")
    succeeded(
        cptune_in_process("train", str(recipe), "--max_steps=2", "--save_steps=1", "--micro_batch_size=1")
    )
    log_before = (tmp_path / "out" / "train_log.json").read_bytes()
    done = cptune_in_process("train", str(recipe), "--resume")
    assert_clean_failure(
        done,
        "--resume: the recipe and overrides given now change 2 settings of the run in",
        "  - max_steps: 2 in the run, 4 now",
        "  - micro_batch_size: 1 in the run, 2 now",
    )
    assert (tmp_path / "out" / "train_log.json").read_bytes() == log_before
    # The same overrides again: the run continues from its newest checkpoint.
    caplog.clear()
    succeeded(
        cptune_in_process(
            "train", str(recipe), "--resume", "--max_steps=2", "--save_steps=1", "--micro_batch_size=1"
        )
    )
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("resuming from") for m in said), said
    # Resuming with --logging_steps=2 (the run logged every step) is allowed and listed.
    caplog.clear()
    succeeded(
        cptune_in_process(
            "train",
            str(recipe),
            "--resume",
            "--max_steps=2",
            "--save_steps=1",
            "--micro_batch_size=1",
            "--logging_steps=2",
        )
    )
    said = [r.getMessage() for r in caplog.records]
    assert "the resume changes settings that do not shape the run: logging_steps: 1 -> 2" in said, said
