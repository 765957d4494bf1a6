"""Catalogue cases of the section "cptune inference" (their text: devtools/docgen/errors/inference.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import Case
from tests.reliability.catalogue.setups import _completion_data, _prompt_files

CASES: tuple[Case, ...] = (
    Case(
        "inference-before-training",
        command="inference",
        args=("--prompt", "Say hello."),
    ),
    Case(
        "inference-base-and-checkpoint",
        command="inference",
        args=("--base", "--checkpoint", "{ws}/out", "--prompt", "Say hello."),
    ),
    Case(
        "inference-prompt-and-prompts",
        command="inference",
        args=("--base", "--prompt", "Say hello.", "--prompts", "{ws}/data/prompts.txt"),
        setup=_prompt_files,
    ),
    Case(
        "inference-sampling-without-do-sample",
        command="inference",
        args=("--base", "--prompt", "Say hello.", "--temperature", "0.7"),
    ),
    Case(
        "inference-prompts-missing",
        command="inference",
        args=("--base", "--prompts", "{ws}/data/no-such-prompts.txt"),
    ),
    Case(
        "inference-prompts-empty",
        command="inference",
        args=("--base", "--prompts", "{ws}/data/empty.txt"),
        setup=_prompt_files,
    ),
    Case(
        "inference-prompts-jsonl-line",
        command="inference",
        args=("--base", "--prompts", "{ws}/data/prompts.jsonl"),
        setup=_prompt_files,
    ),
    Case(
        "inference-prompt-too-long",
        command="inference",
        args=("--base", "--prompts", "{ws}/data/long.txt"),
        setup=_prompt_files,
    ),
    Case(
        "inference-score-empty",
        command="inference",
        args=("--base", "--prompt", "Say hello.", "--score", ""),
        setup=_completion_data,
    ),
)
