"""Troubleshooting entries of the section "cptune inference"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "cptune inference"
NOTE: str | None = None
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "inference-before-training",
        SECTION,
        "cptune inference before training",
        "holds no trained adapter or model yet. Train first (cptune train), pass --checkpoint",
        "Train first, point `--checkpoint` at a folder with an adapter or model, or add `--base` to try "
        "the base model alone (to compare with the fine-tuned one later).",
    ),
    Entry(
        "inference-base-and-checkpoint",
        SECTION,
        "--base together with --checkpoint",
        "--base and --checkpoint: give one of them",
        "`--base` tries the base model alone; `--checkpoint` a trained adapter or model. Give one.",
    ),
    Entry(
        "inference-prompt-and-prompts",
        SECTION,
        "--prompt together with --prompts",
        "--prompt and --prompts: give one of them",
        "Give one prompt with `--prompt`, or a file of prompts with `--prompts` (without either, each line "
        "typed on standard input is a prompt).",
    ),
    Entry(
        "inference-sampling-without-do-sample",
        SECTION,
        "--temperature, --top-p or --top-k without --do-sample",
        "--temperature: sampling options apply only with --do-sample",
        "Generation is greedy by default, which would ignore the sampling options (as transformers' "
        "`generate` does). Add `--do-sample` to sample, or leave them out.",
    ),
    Entry(
        "inference-prompts-missing",
        SECTION,
        "--prompts names a file that does not exist",
        "is not a file; give a text file of prompts, one per line",
        "Check the path (relative paths are read from the current folder). A `.jsonl` file holds rows in the "
        "format of the recipe's first dataset, without the answer.",
    ),
    Entry(
        "inference-prompts-empty",
        SECTION,
        "--prompts names a file without a prompt",
        "' holds no prompt.",
        "Write one prompt per line (empty lines are skipped).",
    ),
    Entry(
        "inference-prompts-jsonl-line",
        SECTION,
        "A line of a .jsonl prompts file is not a row",
        "line 2: each line of a .jsonl file of prompts must be a JSON object",
        "Write each prompt as a row of the data without its answer, e.g. "
        '`{"instruction": "...", "input": "..."}` for alpaca data or `{"messages": [...]}` ending with the '
        "user's message for chat data; or use a plain text file with one prompt per line.",
    ),
    Entry(
        "inference-prompt-too-long",
        SECTION,
        "A prompt longer than the model's context",
        "line 1: the prompt is 27029 tokens, but the model's context is 8192 tokens",
        "The prompt (in the training format) must leave room for at least one new token within the model's "
        "`max_position_embeddings`; with `--score`, the prompt and the completion must fit. Shorten it.",
    ),
    Entry(
        "inference-score-empty",
        SECTION,
        "--score with an empty completion",
        "--score: the completion has no token to score",
        'Give the completion whose log-likelihood you want, e.g. `--score "loud"`. (For alpaca and chat '
        "data an empty answer is refused like an empty answer in the data.)",
    ),
)

DOCUMENTED: tuple[Documented, ...] = ()
