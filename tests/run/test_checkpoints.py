"""Atomic checkpoints, rotation and the choice of the checkpoint to resume from (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cptune.config.loader import validate_recipe
from cptune.errors import CptuneError
from cptune.run.training.checkpoints import (
    CHECKPOINT_MARKER,
    STAGING_DIR,
    complete_checkpoints,
    is_complete_checkpoint,
    latest_complete_checkpoint,
    resume_checkpoint,
    rotate,
    save_checkpoint_atomically,
)


class SimulatedCrash(Exception):
    pass


def fake_trainer_write(step: int, *, crash_after: str | None = None):
    """What the Trainer writes into ``staging_root/checkpoint-N``; raises after ``crash_after`` if given."""

    def write(staging_root: Path) -> None:
        folder = staging_root / f"checkpoint-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("adapter_model.safetensors", "optimizer.pt", "rng_state_0.pth", "trainer_state.json"):
            (folder / name).write_text(f"{name} of step {step}")
            if name == crash_after:
                raise SimulatedCrash(name)

    return write


def save(output_dir: Path, step: int, limit: int | None = None, crash_after: str | None = None) -> Path:
    return save_checkpoint_atomically(
        output_dir=output_dir,
        step=step,
        is_writer=True,
        barrier=lambda: None,
        write=fake_trainer_write(step, crash_after=crash_after),
        save_total_limit=limit,
    )


def recipe(tmp_path: Path, resume) -> object:
    return validate_recipe(
        {
            "base_model": "m",
            "datasets": [{"path": "d.jsonl"}],
            "output_dir": str(tmp_path),
            "resume_from_checkpoint": resume,
        }
    )


def test_a_saved_checkpoint_is_complete_and_lists_its_files(tmp_path):
    path = save(tmp_path, 3)
    assert path == tmp_path / "checkpoint-3" and is_complete_checkpoint(path)
    marker = json.loads((path / CHECKPOINT_MARKER).read_text())
    assert marker["step"] == 3 and set(marker["files"]) >= {"optimizer.pt", "rng_state_0.pth"}
    assert not (tmp_path / STAGING_DIR).exists()


def test_a_crash_during_the_write_leaves_the_previous_checkpoint_and_nothing_that_looks_complete(tmp_path):
    save(tmp_path, 3)
    with pytest.raises(SimulatedCrash):
        save(tmp_path, 6, crash_after="optimizer.pt")
    assert not (tmp_path / "checkpoint-6").exists()
    assert (tmp_path / STAGING_DIR / "checkpoint-6" / "optimizer.pt").is_file()
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-3"
    assert resume_checkpoint(recipe(tmp_path, True)) == tmp_path / "checkpoint-3"
    # The next save starts from a clean staging folder: no file of the crashed save survives.
    save(tmp_path, 6)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [3, 6]
    assert not (tmp_path / STAGING_DIR).exists()


def test_a_folder_missing_a_listed_file_or_with_another_size_is_not_complete(tmp_path):
    path = save(tmp_path, 2)
    (path / "optimizer.pt").write_text("truncated")
    assert not is_complete_checkpoint(path)
    other = save(tmp_path, 4)
    (other / "rng_state_0.pth").unlink()
    assert not is_complete_checkpoint(other)
    bare = tmp_path / "checkpoint-8"  # e.g. written by another tool, or copied in part
    bare.mkdir()
    (bare / "optimizer.pt").write_text("x")
    assert latest_complete_checkpoint(tmp_path) is None


def test_a_marker_copied_from_another_step_does_not_count(tmp_path):
    path = save(tmp_path, 2)
    copy = tmp_path / "checkpoint-5"
    copy.mkdir()
    for file in path.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    assert not is_complete_checkpoint(copy)


def test_rotation_keeps_the_newest_complete_checkpoints_and_ignores_partial_ones(tmp_path):
    for step in (2, 4, 6):
        save(tmp_path, step, limit=2)
    (tmp_path / "checkpoint-1").mkdir()  # incomplete: never counted, never deleted by rotation
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 6]
    assert rotate(tmp_path, 1) == [tmp_path / "checkpoint-4"]
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [6]
    assert (tmp_path / "checkpoint-1").is_dir()
    assert rotate(tmp_path, None) == []


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    save(tmp_path, 4)
    (tmp_path / "checkpoint-4" / "stale.txt").write_text("from the first run")
    save(tmp_path, 4)
    assert is_complete_checkpoint(tmp_path / "checkpoint-4")
    assert not (tmp_path / "checkpoint-4" / "stale.txt").exists()


def test_resume_choices(tmp_path):
    assert resume_checkpoint(recipe(tmp_path, None)) is None
    assert resume_checkpoint(recipe(tmp_path, False)) is None
    with pytest.raises(CptuneError, match="no complete checkpoint in output_dir"):
        resume_checkpoint(recipe(tmp_path, True))
    (tmp_path / "checkpoint-9").mkdir()
    with pytest.raises(CptuneError, match=r"incomplete, ignored: checkpoint-9"):
        resume_checkpoint(recipe(tmp_path, True))
    first, second = save(tmp_path, 2), save(tmp_path, 5)
    assert resume_checkpoint(recipe(tmp_path, True)) == second
    assert resume_checkpoint(recipe(tmp_path, str(first))) == first
    with pytest.raises(CptuneError, match="not a complete cptune checkpoint"):
        resume_checkpoint(recipe(tmp_path, str(tmp_path / "checkpoint-9")))


def test_resume_from_checkpoint_is_a_recipe_key_and_auto_resume_points_to_it(tmp_path):
    from cptune.errors import RecipeError

    assert recipe(tmp_path, True).resume_from_checkpoint is True
    assert recipe(tmp_path, "runs/checkpoint-4").resume_from_checkpoint == "runs/checkpoint-4"
    with pytest.raises(RecipeError) as info:
        validate_recipe(
            {"base_model": "m", "datasets": [{"path": "d"}], "auto_resume_from_checkpoints": True}
        )
    message = str(info.value)
    assert "auto_resume_from_checkpoints: is an Axolotl key" in message
    assert "resume_from_checkpoint: true" in message
