"""A run keeps its resolved recipe and overrides; ``--resume`` continues that same run and refuses to reshape it."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import yaml

from cptune.config.loader import load_recipe
from cptune.errors import CptuneError, RecipeError
from cptune.run.training import train as train_module
from cptune.run.training.run_recipe import (
    RUN_RECIPE_NAME,
    check_resumed_recipe,
    resumed_recipe,
    save_run_recipe,
    saved_overrides,
)
from tests.conftest import succeeded
from tests.run.test_cli_errors import assert_clean_failure

STARTED_WITH = ["--max_steps=6", "--learning_rate=0.01", "--save_steps=2", "--datasets.0.split=train"]


def fake_checkpoint(run_dir):
    """A folder that passes for a complete checkpoint-2 of the run in ``run_dir``."""
    from cptune.run.training.checkpoints import write_marker

    checkpoint = run_dir / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    write_marker(checkpoint, 2)
    return checkpoint


def test_the_saved_recipe_holds_the_overrides_and_a_resume_applies_them_again(write_recipe, tmp_path):
    path = write_recipe()
    started = load_recipe(path, STARTED_WITH)
    # A value with a space survives the trip through the file's comment line.
    saved = save_run_recipe(started, [*STARTED_WITH, "--wandb_name=a b"])
    assert saved == tmp_path / "out" / RUN_RECIPE_NAME
    assert yaml.safe_load(saved.read_text()) == started.model_dump(mode="json")
    assert saved_overrides(tmp_path / "out") == [*STARTED_WITH, "--wandb_name=a b"]
    save_run_recipe(started, STARTED_WITH)
    checkpoint = fake_checkpoint(tmp_path / "out")

    # No overrides given: the run's own are applied again, and the resume continues that run.
    resuming = load_recipe(path, ["--resume_from_checkpoint=true"])
    assert resuming.max_steps == 4
    recipe, reapplied = resumed_recipe(resuming, path, [])
    assert reapplied == STARTED_WITH
    assert (recipe.max_steps, recipe.learning_rate, recipe.save_steps) == (6, 0.01, 2)
    assert recipe.datasets[0].split == "train"
    assert recipe.resume_from_checkpoint is True
    assert check_resumed_recipe(recipe, checkpoint) == []

    # Overrides given now win over the run's: a harmless one is listed, a shaping one refused.
    now = ["--resume_from_checkpoint=true", "--logging_steps=3"]
    recipe, _ = resumed_recipe(load_recipe(path, now), path, now)
    assert check_resumed_recipe(recipe, checkpoint) == ["logging_steps: 1 -> 3"]
    now = ["--resume_from_checkpoint=true", "--max_steps=8", "--micro_batch_size=1"]
    recipe, _ = resumed_recipe(load_recipe(path, now), path, now)
    with pytest.raises(CptuneError) as refused:
        check_resumed_recipe(recipe, checkpoint)
    message = str(refused.value)
    assert "change 2 settings of the run in" in message, message
    assert "  - max_steps: 6 in the run, 8 now" in message, message
    assert "  - micro_batch_size: 2 in the run, 1 now" in message, message
    assert f"({' '.join(STARTED_WITH)})" in message, message
    assert str(saved) in message

    # An edit of the recipe file that shapes the run is refused the same way.
    edited = write_recipe(sequence_len=256)
    recipe, _ = resumed_recipe(load_recipe(edited, ["--resume_from_checkpoint=true"]), edited, [])
    with pytest.raises(CptuneError, match="  - sequence_len: 128 in the run, 256 now"):
        check_resumed_recipe(recipe, checkpoint)

    # Not resuming, or --overwrite: the recipe as given.
    fresh = load_recipe(path)
    assert resumed_recipe(fresh, path, []) == (fresh, [])
    assert check_resumed_recipe(fresh, None) == []


def test_a_resume_refuses_embeddings_of_other_rows(write_recipe, tmp_path):
    """resize_token_embeddings_to_32x shapes the model: the checkpoint's embeddings would not fit the other rows."""
    save_run_recipe(load_recipe(write_recipe()))
    checkpoint = fake_checkpoint(tmp_path / "out")
    edited = write_recipe(resize_token_embeddings_to_32x=True)
    recipe, _ = resumed_recipe(load_recipe(edited, ["--resume_from_checkpoint=true"]), edited, [])
    with pytest.raises(CptuneError, match="  - resize_token_embeddings_to_32x: false in the run, true now"):
        check_resumed_recipe(recipe, checkpoint)
    # New tokens shape it too (and their ids are in the data).
    edited = write_recipe(tokens=["<tool>"])
    recipe, _ = resumed_recipe(load_recipe(edited, ["--resume_from_checkpoint=true"]), edited, [])
    with pytest.raises(CptuneError, match=r"  - tokens: unset in the run, \[<tool>\] now"):
        check_resumed_recipe(recipe, checkpoint)


def test_a_resume_refuses_other_unfrozen_parameters(write_recipe, tmp_path):
    """unfrozen_parameters decide what trains: the checkpoint's optimizer state holds those parameters only."""
    save_run_recipe(load_recipe(write_recipe(adapter=None, unfrozen_parameters=["^lm_head"])))
    checkpoint = fake_checkpoint(tmp_path / "out")
    edited = write_recipe(adapter=None, unfrozen_parameters=["^lm_head", "model.norm"])
    recipe, _ = resumed_recipe(load_recipe(edited, ["--resume_from_checkpoint=true"]), edited, [])
    with pytest.raises(
        CptuneError, match=r"  - unfrozen_parameters: \[\^lm_head\] in the run, \[\^lm_head, model.norm\] now"
    ):
        check_resumed_recipe(recipe, checkpoint)


def test_the_runs_overrides_that_no_longer_fit_the_recipe_file_are_named(write_recipe, tmp_path):
    path = write_recipe()
    save_run_recipe(load_recipe(path, ["--datasets.0.split=train"]), ["--datasets.1.split=train"])
    fake_checkpoint(tmp_path / "out")
    with pytest.raises(RecipeError) as refused:
        resumed_recipe(load_recipe(path, ["--resume_from_checkpoint=true"]), path, [])
    assert f"with the overrides of the run in {tmp_path / 'out'}, --datasets.1.split=train" in str(
        refused.value
    )
    assert "override index '1' is out of range (list of 1)" in str(refused.value)


def test_output_dir_and_the_resume_keys_of_the_runs_overrides_are_not_applied_again(write_recipe, tmp_path):
    """A moved run folder is resumed where it is; the run's --overwrite does not undo the resume."""
    path = write_recipe()
    moved = tmp_path / "moved"
    started = ["--output_dir=somewhere/else", "--overwrite_output_dir=true", "--max_steps=6"]
    save_run_recipe(load_recipe(path, [f"--output_dir={moved}", "--max_steps=6"]), started)
    fake_checkpoint(moved)
    now = ["--resume_from_checkpoint=true", f"--output_dir={moved}"]
    recipe, reapplied = resumed_recipe(load_recipe(path, now), path, now)
    assert reapplied == ["--max_steps=6"]
    assert (recipe.output_dir, recipe.max_steps, recipe.overwrite_output_dir) == (str(moved), 6, False)


def test_a_run_saved_without_overrides_or_by_an_older_cptune_is_checked_only(write_recipe, tmp_path):
    path = write_recipe()
    saved = save_run_recipe(load_recipe(path))
    assert "# overrides:\n" in saved.read_text()
    assert saved_overrides(tmp_path / "out") == []
    checkpoint = fake_checkpoint(tmp_path / "out")
    resuming = load_recipe(path, ["--resume_from_checkpoint=true"])
    assert resumed_recipe(resuming, path, []) == (resuming, [])
    # A resume keeps the run's file; without one (an older cptune) there is nothing to compare.
    assert save_run_recipe(resuming, ["--max_steps=9"]) is None
    assert saved_overrides(tmp_path / "out") == []
    saved.unlink()
    assert resumed_recipe(resuming, path, []) == (resuming, [])
    assert check_resumed_recipe(load_recipe(path, ["--max_steps=9"]), checkpoint) == []


def interrupt_after_saving(step: int, monkeypatch) -> None:
    """Make the next run in this process stop like a Ctrl-C right after it saved checkpoint ``step``."""
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise KeyboardInterrupt

    build = train_module.build_trainer

    def build_interrupted(*args, **kwargs):
        trainer = build(*args, **kwargs)
        trainer.add_callback(Interrupt())
        return trainer

    monkeypatch.setattr(train_module, "build_trainer", build_interrupted)


def logged(out, key: str) -> dict[int, float]:
    history = json.loads((out / "train_log.json").read_text())
    return {entry["step"]: entry[key] for entry in history if key in entry}


def test_resume_without_overrides_continues_the_interrupted_run_as_it_would_have_gone_on(
    write_recipe, cptune_in_process, tmp_path, caplog, monkeypatch
):
    """The issue's case: a run started with overrides, interrupted, resumed with none."""
    # The recipe file says 8 steps; the run is started with 4 (and its own checkpoint and eval cadence).
    recipe = write_recipe(max_steps=8, val_set_size=8, warmup_steps=1)
    overrides = ["--max_steps=4", "--save_steps=2", "--eval_steps=2"]
    reference = tmp_path / "uninterrupted"
    succeeded(cptune_in_process("train", str(recipe), *overrides, f"--output_dir={reference}"))

    out = tmp_path / "out"
    with monkeypatch.context() as patched:
        interrupt_after_saving(2, patched)
        # click turns the KeyboardInterrupt into its Abort, and cptune exits 130 as after a Ctrl-C.
        assert cptune_in_process("train", str(recipe), *overrides).returncode == 130
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
    assert not (out / "train_log.json").exists()

    caplog.set_level(logging.INFO, logger="cptune")
    succeeded(cptune_in_process("train", str(recipe), "--resume"))
    said = [r.getMessage() for r in caplog.records]
    assert f"--resume: continuing with the overrides the run was started with: {' '.join(overrides)}" in said
    assert f"resuming from {out / 'checkpoint-2'}" in said, said
    assert not any("do not shape the run" in m for m in said), said

    for key in ("loss", "learning_rate", "eval_loss"):
        expected, resumed = logged(reference, key), logged(out, key)
        assert sorted(expected) == ([2, 4] if key == "eval_loss" else [1, 2, 3, 4]), (key, expected)
        after = {step: value for step, value in expected.items() if step > 2}
        # Exact: the resumed run repeats the uninterrupted run's operations in the same process,
        # from a state restored bit for bit (weights, optimizer, schedule, RNG, data position).
        assert {step: resumed[step] for step in after} == after, (key, resumed, expected)
    # The schedule is the run's 4 steps, not the file's 8: cosine after 1 warmup step, at step 4 the
    # rate is 0.002 * (1 + cos(pi * 2/3)) / 2 (over 8 steps it would be 0.002 * (1 + cos(pi * 2/7)) / 2).
    # The bound is float64 rounding of the schedule's few operations.
    assert logged(out, "learning_rate")[4] == pytest.approx(
        0.002 * (1 + math.cos(math.pi * 2 / 3)) / 2, rel=1e-12
    )
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]


def test_train_resume_that_reshapes_the_run_is_refused_before_any_work(
    write_recipe, cptune_in_process, tmp_path, caplog
):
    recipe = write_recipe()
    caplog.set_level(logging.INFO, logger="cptune")
    started = ["--max_steps=2", "--save_steps=1", "--micro_batch_size=1"]
    succeeded(cptune_in_process("train", str(recipe), *started))
    log_before = (tmp_path / "out" / "train_log.json").read_bytes()
    done = cptune_in_process("train", str(recipe), "--resume", "--max_steps=3", "--micro_batch_size=2")
    assert_clean_failure(
        done,
        "--resume: the recipe and overrides given now change 2 settings of the run in",
        "  - max_steps: 2 in the run, 3 now",
        "  - micro_batch_size: 1 in the run, 2 now",
        f"applies the overrides the run was started with ({' '.join(started)}) itself",
    )
    assert (tmp_path / "out" / "train_log.json").read_bytes() == log_before
    # An edit of the recipe file that reshapes the run: refused the same way.
    shutil.copy(recipe, tmp_path / "kept.yaml")
    write_recipe(learning_rate=0.005)
    assert_clean_failure(
        cptune_in_process("train", str(recipe), "--resume"),
        "  - learning_rate: 0.002 in the run, 0.005 now",
    )
    shutil.copy(tmp_path / "kept.yaml", recipe)
    # A harmless change (the run logged every step) is applied and listed; the run's overrides apply.
    caplog.clear()
    succeeded(cptune_in_process("train", str(recipe), "--resume", "--logging_steps=2"))
    said = [r.getMessage() for r in caplog.records]
    assert "the resume changes settings that do not shape the run: logging_steps: 1 -> 2" in said, said
    assert any(m.startswith("resuming from") for m in said), said
