"""Checkpoints that are either complete or invisible, their rotation, and what resume starts from.

The Trainer writes a checkpoint file by file, from several processes (rank 0
writes the model, optimizer and trainer state; every rank its RNG state). A
crash half-way would leave ``checkpoint-N`` looking like a checkpoint. cptune
therefore has the Trainer write into ``output_dir/.cptune-staging/checkpoint-N``;
once every rank has finished, rank 0 writes the :data:`CHECKPOINT_MARKER` (the list of
files and their sizes) and renames the folder to ``output_dir/checkpoint-N`` in
one ``rename`` (:func:`cptune.atomic.publish_folder`). A checkpoint is *complete*
(:func:`is_complete_checkpoint`) when it sits in ``output_dir``, has the marker, and
every file the marker lists is there with its size. Resume only
ever starts from a complete checkpoint; leftovers in the staging folder are
ignored and removed by the next save.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from cptune.atomic import Marker, discard_folder, publish_folder
from cptune.atomic import write_marker as write_folder_marker
from cptune.config.recipe import Recipe
from cptune.errors import CptuneError

log = logging.getLogger("cptune.checkpoints")

# The Trainer's folder name (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR) and step pattern.
CHECKPOINT_PREFIX = "checkpoint"
CHECKPOINT_MARKER = "cptune_checkpoint_complete.json"
"""Written last into a checkpoint: its step and every file with its size (see :func:`is_complete_checkpoint`).

(Not the data cache's marker: :data:`cptune.data.cache.BUILT_MARKER` holds a fingerprint.)
"""
STAGING_DIR = ".cptune-staging"
_CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")


def checkpoint_step(path: Path) -> int | None:
    """The step in a ``checkpoint-N`` folder name, or None for any other name."""
    match = _CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


def checkpoint_folders(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Every ``checkpoint-N`` folder directly in ``output_dir``, complete or not, by step."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if p.is_dir()]
    return sorted((step, path) for step, path in found if step is not None)


def is_complete_checkpoint(path: str | Path) -> bool:
    """True when ``path`` holds a finished checkpoint: a valid marker, and every file it lists.

    Checking the listed files and sizes (not only the marker) also catches a
    checkpoint that was copied or deleted from only in part after it was written.
    """
    path = Path(path)
    try:
        marker = json.loads((path / CHECKPOINT_MARKER).read_text())
        files = marker["files"]
        if marker["step"] != checkpoint_step(path):
            return False
        return all(
            (path / name).is_file() and (path / name).stat().st_size == size for name, size in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``output_dir``, oldest first."""
    return [(step, path) for step, path in checkpoint_folders(output_dir) if is_complete_checkpoint(path)]


def latest_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1][1] if done else None


def resume_checkpoint(recipe: Recipe) -> Path | None:
    """The checkpoint a run resumes from, as ``resume_from_checkpoint`` says (None: start afresh).

    Raises:
        CptuneError: resuming was asked for, but there is no complete checkpoint to resume from.
    """
    wanted = recipe.resume_from_checkpoint
    if wanted is None or wanted is False:
        return None
    if wanted is True:
        latest = latest_complete_checkpoint(recipe.output_dir)
        if latest is None:
            partial = [
                p.name for _, p in checkpoint_folders(recipe.output_dir) if not is_complete_checkpoint(p)
            ]
            seen = f" (incomplete, ignored: {', '.join(partial)})" if partial else ""
            raise CptuneError(
                f"resume_from_checkpoint: there is no complete checkpoint in output_dir '{recipe.output_dir}' "
                f"to resume from{seen}. Train without --resume (or resume_from_checkpoint) to start from "
                "scratch, or point output_dir at the run you want to continue."
            )
        return latest
    path = Path(wanted)
    if not is_complete_checkpoint(path):
        raise CptuneError(
            f"resume_from_checkpoint: '{path}' is not a complete cptune checkpoint (no {CHECKPOINT_MARKER} "
            "matching its files; a save that was interrupted leaves no such marker). Give a "
            f"'{CHECKPOINT_PREFIX}-N' folder that cptune finished writing, or 'true' for the newest one "
            "in output_dir."
        )
    return path


def checkpoint_marker(step: int) -> Marker:
    """The :data:`CHECKPOINT_MARKER` of a checkpoint of ``step``: the step, and every file with its size."""
    return Marker(CHECKPOINT_MARKER, {"step": step}, list_files=True)


def write_marker(folder: Path, step: int) -> None:
    """Flush every file of ``folder`` to disk, then write its checkpoint marker (atomically)."""
    write_folder_marker(folder, checkpoint_marker(step))


def publish(staged: Path, final: Path, step: int) -> None:
    """Mark ``staged`` complete and move it to ``final`` in one rename (rank 0 only).

    A checkpoint of the same step that is already there (a run resumed from an
    older checkpoint saves that step again) is moved aside first: ``final`` is
    never half-replaced (a crash between the two renames leaves it absent, and
    resume takes the newest complete checkpoint before it).
    """
    publish_folder(
        staged, final, marker=checkpoint_marker(step), aside=staged.parent / f"replaced-{final.name}"
    )


def rotate(output_dir: str | Path, save_total_limit: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``save_total_limit``; returns what was deleted.

    The newest complete checkpoint is always kept. A checkpoint is first renamed
    into the staging folder and only then deleted, so a crash during deletion
    never leaves a half-deleted folder under a checkpoint name.
    """
    if not save_total_limit:
        return []
    root = Path(output_dir)
    done = complete_checkpoints(root)
    doomed = [path for _, path in done[: max(len(done) - save_total_limit, 0)]]
    if doomed:
        (root / STAGING_DIR).mkdir(exist_ok=True)
    for path in doomed:
        discard_folder(path, root / STAGING_DIR / f"deleted-{path.name}")
    return doomed


def save_checkpoint_atomically(
    *,
    output_dir: str | Path,
    step: int,
    is_writer: bool,
    barrier: Callable[[], None],
    write: Callable[[Path], None],
    save_total_limit: int | None,
) -> Path:
    """Write checkpoint ``step`` through ``write(staging_root)`` and publish it when every rank is done.

    Args:
        output_dir: The run's output folder.
        step: The optimizer step being saved.
        is_writer: True on the one process that writes shared files (the Trainer's ``should_save``).
        barrier: Waits for every process of the run.
        write: Writes the checkpoint as ``staging_root/checkpoint-{step}`` (the Trainer's own save,
            pointed at the staging folder); runs on every process.
        save_total_limit: Complete checkpoints to keep, or None for all.

    Returns:
        The published checkpoint folder.
    """
    root = Path(output_dir)
    staging_root = root / STAGING_DIR
    staged = staging_root / f"{CHECKPOINT_PREFIX}-{step}"
    if is_writer:
        # Only one save runs at a time, so whatever is staged is a leftover of a save that
        # crashed: it must not mix with this one's files.
        shutil.rmtree(staging_root, ignore_errors=True)
        staging_root.mkdir(parents=True)
    barrier()
    write(staging_root)
    barrier()  # every rank's files (RNG states) are written
    final = root / f"{CHECKPOINT_PREFIX}-{step}"
    if is_writer:
        publish(staged, final, step)
        for path in rotate(root, save_total_limit):
            log.info("deleted %s (save_total_limit=%s)", path.name, save_total_limit)
        shutil.rmtree(staging_root, ignore_errors=True)
    barrier()  # nobody goes on before the checkpoint is visible (e.g. to a callback that reads it)
    return final
