"""Troubleshooting entries of the section "The output folder and resuming"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "The output folder and resuming"
NOTE: str | None = None
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "output-dir-is-file",
        SECTION,
        "output_dir is a file",
        "is a file; give a folder path.",
        "Give a folder path; the file is left as it is.",
    ),
    Entry(
        "output-dir-below-file",
        SECTION,
        "output_dir lies below a file",
        "cannot be created because",
        "A parent of output_dir is a file; choose another output_dir.",
    ),
    Entry(
        "output-dir-not-writable",
        SECTION,
        "output_dir cannot be written",
        "does not allow this user to write). Choose an output_dir you can write to",
        "Choose an output_dir you can write to, or change the folder's permissions. This is checked "
        "before any process starts, not when the first checkpoint is saved.",
    ),
    Entry(
        "output-dir-finished-run",
        SECTION,
        "output_dir holds a finished run",
        "already holds an earlier run (adapter_model.safetensors, train_log.json); cptune does not "
        "replace it without being told.",
        "Choose another output_dir to keep it, or pass `--overwrite` (or set `overwrite_output_dir: true`) "
        "to start afresh: the earlier checkpoints and train log are removed, the model is replaced when "
        "the new run saves.",
    ),
    Entry(
        "output-dir-earlier-checkpoints",
        SECTION,
        "output_dir holds checkpoints of an earlier run",
        "already holds an earlier run (checkpoint-2); cptune does not replace it without being told. "
        "To keep it, choose another output_dir; pass --resume to continue it",
        "Pass `--resume` to continue that run from its newest checkpoint, `--overwrite` to start afresh, "
        "or choose another output_dir.",
    ),
    Entry(
        "resume-without-checkpoint",
        SECTION,
        "--resume with no complete checkpoint",
        "there is no complete checkpoint in output_dir",
        "A checkpoint whose save was interrupted has no completion marker and is never resumed from. "
        "Train without `--resume` to start from scratch, or point output_dir at the run to continue.",
    ),
    Entry(
        "resume-incomplete-path",
        SECTION,
        "resume_from_checkpoint names an incomplete checkpoint",
        "is not a complete cptune checkpoint",
        "Give a `checkpoint-N` folder that cptune finished writing, or `true` for the newest complete one.",
    ),
    Entry(
        "resume-changed-settings",
        SECTION,
        "--resume with a recipe or overrides that change the run (steps, schedule, batch, data, parallelism)",
        "which a resume must keep (it would continue a different run from the middle of this one)",
        "A resume trains with the recipe file given now, the overrides the run was started with (saved in "
        "`output_dir/run_recipe.yaml`; you need not repeat them) and the overrides given now. The message "
        "lists each key that would change how the run is shaped, with the run's value and the new one: drop "
        "the overrides that change them, or put the recipe file's values back. To train with the new values, "
        "start a new run with `--overwrite` or another output_dir.",
    ),
)

DOCUMENTED: tuple[Documented, ...] = ()
