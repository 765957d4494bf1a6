"""Catalogue cases of the section "The output folder and resuming" (their text: devtools/docgen/errors/output.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import Case
from tests.reliability.catalogue.setups import (
    _finished_run,
    _incomplete_checkpoint,
    _interrupted_run_with_checkpoint,
    _output_dir_below_file,
    _output_dir_is_file,
    _output_dir_read_only,
    _resume_path_incomplete,
    _run_with_other_settings,
)

CASES: tuple[Case, ...] = (
    Case(
        "output-dir-is-file",
        setup=_output_dir_is_file,
    ),
    Case(
        "output-dir-below-file",
        setup=_output_dir_below_file,
    ),
    Case(
        "output-dir-not-writable",
        setup=_output_dir_read_only,
    ),
    Case(
        "output-dir-finished-run",
        setup=_finished_run,
        subprocess=True,
    ),
    Case(
        "output-dir-earlier-checkpoints",
        setup=_interrupted_run_with_checkpoint,
    ),
    Case(
        "resume-without-checkpoint",
        setup=_incomplete_checkpoint,
        args=("--resume",),
    ),
    Case(
        "resume-incomplete-path",
        setup=_resume_path_incomplete,
    ),
    Case(
        "resume-changed-settings",
        setup=_run_with_other_settings,
        args=("--resume",),
    ),
)
