"""The output folder: usable before a run starts, and never holding an earlier run that a new one would replace.

A run writes its checkpoints, its train log and its final model into
``output_dir``. Starting a fresh run in a folder that already holds an earlier
run would mix the two runs' checkpoints (resume would then pick the wrong one)
and replace the earlier model without a word, so cptune refuses unless the user
says what to do: ``--resume`` continues the earlier run, ``--overwrite``
(``overwrite_output_dir: true``) starts afresh and removes its checkpoints and
train log first.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError
from cptune.run.training.checkpoints import STAGING_DIR, checkpoint_folders, complete_checkpoints

log = logging.getLogger("cptune.output_dir")

TRAIN_LOG_NAME = "train_log.json"

# What a finished run leaves in output_dir (the Trainer's save_model: an adapter or a full model).
FINAL_MODEL_FILES = (
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_output_dir(recipe: Recipe, *, writable: bool = True) -> None:
    """Refuse an ``output_dir`` that is a file, sits below a file, or cannot be written.

    Args:
        recipe: The validated recipe.
        writable: Also require that the run can create and write the folder (training does).
    """
    path = Path(recipe.output_dir)
    if path.exists() and not path.is_dir():
        raise CptuneError(f"output_dir: '{path}' is a file; give a folder path.")
    if not writable:
        return
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise CptuneError(
            f"output_dir: '{path}' cannot be created because '{existing}' is a file, not a folder. "
            "Give an output_dir below a folder."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "output_dir" if existing == path else f"its nearest existing parent '{existing}'"
        raise CptuneError(
            f"output_dir: '{path}' is not writable ({what} does not allow this user to write). "
            "Choose an output_dir you can write to, or change the folder's permissions."
        )


def earlier_run(output_dir: str | Path) -> list[str]:
    """What an earlier run left in ``output_dir`` (empty when nothing): final model, train log, checkpoints."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [name for name in (*FINAL_MODEL_FILES, TRAIN_LOG_NAME) if (root / name).is_file()]
    found += [path.name for _, path in complete_checkpoints(root)]
    return found


def check_earlier_run(recipe: Recipe) -> None:
    """Refuse to start a fresh run over an earlier one unless the recipe resumes or overwrites it."""
    if recipe.resume_from_checkpoint not in (None, False) or recipe.overwrite_output_dir:
        return
    found = earlier_run(recipe.output_dir)
    if not found:
        return
    shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    resumable = bool(complete_checkpoints(recipe.output_dir))
    resume = "pass --resume to continue it from its newest checkpoint, " if resumable else ""
    raise CptuneError(
        f"output_dir: '{recipe.output_dir}' already holds an earlier run ({shown}); cptune does not "
        f"replace it without being told. To keep it, choose another output_dir; {resume}or pass "
        "--overwrite (or set overwrite_output_dir: true) to start afresh, which removes its checkpoints "
        "and train log."
    )


def clear_earlier_run(recipe: Recipe) -> list[Path]:
    """With ``overwrite_output_dir``: remove the earlier run's checkpoints and train log (one process only).

    The final model files are replaced when the new run saves. Returns what was removed.
    """
    if not recipe.overwrite_output_dir:
        return []
    root = Path(recipe.output_dir)
    doomed = [path for _, path in checkpoint_folders(root)]
    doomed += [p for p in (root / STAGING_DIR, root / TRAIN_LOG_NAME) if p.exists()]
    for path in doomed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if doomed:
        log.info(
            "overwrite_output_dir: removed the earlier run's %s from %s",
            ", ".join(p.name for p in doomed),
            root,
        )
    return doomed
