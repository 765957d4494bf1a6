"""Prompts in the training format: what ``cptune inference`` gives the model, token for token.

A prompt is cut from what the dataset's own formatter
(:func:`cptune.data.formats.build_formatter`) makes of a row with a placeholder
answer: every token before the answer's first trained token. So an alpaca prompt
is the ``### Instruction: ... ### Response:`` text with the tokenizer's bos, a
chat prompt is the conversation rendered by the recipe's chat template up to and
including the assistant header (``add_generation_prompt``), and a completion
prompt is the text after bos, all exactly as in training. Scoring a completion
formats the row with that completion as the answer and sums the log-likelihood
of the tokens training would have trained.

Prompts come from ``--prompt``, a file (one per line, or JSON-lines rows of the
data's format without the answer) or standard input (:func:`prompt_items`);
:func:`prepare_prompt` turns one into token ids checked against the model's context.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from cptune.config.data import DatasetConfig
from cptune.data.formats import Formatter, RowProblem, build_formatter
from cptune.errors import CptuneError, DataError
from cptune.labels import IGNORE_INDEX

__all__ = ["Prepared", "PromptItem", "Prompter", "ScoredText", "prepare_prompt", "prompt_items"]

_PLACEHOLDER = "x"


@dataclass(frozen=True)
class ScoredText:
    """A prompt followed by a completion, and which tokens of it the score sums over."""

    input_ids: list[int]
    scored: list[int]


@dataclass(frozen=True)
class Prompter:
    """Builds prompts (and prompt + completion) for rows of one dataset's format.

    Args:
        config: The dataset entry whose format to use (``type`` and field names).
        tokenizer: The model's tokenizer.
        chat_template: The recipe's ``chat_template``.
        chat_template_jinja: The recipe's ``chat_template_jinja``.
        eot_tokens: The recipe's ``eot_tokens``.
    """

    config: DatasetConfig
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None
    chat_template_jinja: str | None = None
    eot_tokens: tuple[str, ...] | None = None

    @property
    def kind(self) -> str:
        # Pretokenized data has no text format: a text prompt is encoded as completion text is.
        row_format = self.config.row_format
        return "completion" if row_format == "pretokenized" else row_format

    @property
    def answer_role(self) -> str:
        return self.config.roles_to_train[0] if self.config.roles_to_train else "assistant"

    @cached_property
    def _formatter(self) -> Formatter:
        # Built once: building a chat formatter checks the template's end tokens (and may warn).
        config = self.config
        if config.row_format == "pretokenized":
            config = DatasetConfig(path=config.path, type="completion")
        # The prompt's tokens do not depend on train_on_inputs; without it the labels show where
        # the answer starts.
        return build_formatter(
            config,
            self.tokenizer,
            train_on_inputs=False,
            chat_template=self.chat_template,
            label="the prompt",
            chat_template_jinja=self.chat_template_jinja,
            eot_tokens=self.eot_tokens,
        )

    def row(self, text: str) -> dict[str, Any]:
        """A row of the dataset's format whose prompt is ``text`` (the instruction, user message or text)."""
        c = self.config
        if self.kind == "alpaca":
            return {c.field_instruction: text, c.field_input: ""}
        if self.kind == "chat_template":
            return {c.field_messages: [{c.message_field_role: "user", c.message_field_content: text}]}
        return {c.field if c.row_format == "completion" else "text": text}

    def _with_answer(self, row: Mapping[str, Any], answer: str) -> dict[str, Any]:
        c = self.config
        if self.kind == "alpaca":
            return {**row, c.field_output: answer}
        messages = [
            *row[c.field_messages],
            {c.message_field_role: self.answer_role, c.message_field_content: answer},
        ]
        return {**row, c.field_messages: messages}

    def _format(self, row: Mapping[str, Any]) -> tuple[list[int], list[int]]:
        if self.config.row_format == "pretokenized":
            row = {"text": row["text"]}
        try:
            sample = self._formatter(row)
        except RowProblem as problem:
            raise DataError(f"{problem.reason}.") from None
        return sample.input_ids, sample.labels

    def prompt_ids(self, row: Mapping[str, Any]) -> list[int]:
        """The token ids training puts before the answer to ``row``."""
        if self.kind == "completion":
            input_ids, _ = self._format(row)
            return input_ids[:-1]  # the text without the eos every completion sample ends with
        input_ids, labels = self._format(self._with_answer(row, _PLACEHOLDER))
        return input_ids[: _last_trained_span_start(labels)]

    def with_completion(self, row: Mapping[str, Any], completion: str) -> ScoredText:
        """The prompt followed by ``completion`` as training would tokenize it, and the positions to score.

        For alpaca and chat data the scored tokens are those training trains in the answer (its
        text and the eos or end-of-turn token after it); for completion data, the completion's
        own tokens after the prompt's (encoded apart, no eos).
        """
        if self.kind == "completion":
            prompt = self.prompt_ids(row)
            completion_ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
            return ScoredText(
                prompt + completion_ids, list(range(len(prompt), len(prompt) + len(completion_ids)))
            )
        input_ids, labels = self._format(self._with_answer(row, completion))
        # The tokens before the answer are the prompt: the formatter refuses a chat template that
        # renders the conversation before a turn differently once the turn follows.
        start = _last_trained_span_start(labels)
        return ScoredText(input_ids, [i for i in range(start, len(input_ids)) if labels[i] != IGNORE_INDEX])

    def stop_token_ids(self) -> list[int]:
        """Tokens that end an answer: eos, and the end-of-turn token training trains after a chat answer."""
        stops = [] if self.tokenizer.eos_token_id is None else [int(self.tokenizer.eos_token_id)]
        if self.kind == "chat_template":
            input_ids, labels = self._format(self._with_answer(self.row(_PLACEHOLDER), _PLACEHOLDER))
            last = max(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
            if input_ids[last] in set(self.tokenizer.all_special_ids) and input_ids[last] not in stops:
                stops.append(int(input_ids[last]))
        return stops


def _last_trained_span_start(labels: list[int]) -> int:
    """Index of the first token of the last run of trained labels (the answer)."""
    end = max(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start


@dataclass(frozen=True)
class PromptItem:
    """One prompt: where it came from (for messages), the text to show, its row in the data's format."""

    origin: str
    shown: str
    row: dict[str, Any]


def _file_items(prompter: Prompter, path: Path) -> Iterator[PromptItem]:
    lines = path.read_text(encoding="utf-8").splitlines()
    jsonl = path.suffix in (".jsonl", ".json")
    config = prompter.config
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        origin = f"--prompts {path}, line {number}"
        if not jsonl:
            yield PromptItem(origin, line, prompter.row(line))
            continue
        try:
            row: Any = json.loads(line)
            found = f"a JSON {type(row).__name__}"
        except ValueError as err:
            row, found = None, f"not valid JSON ({err})"
        if not isinstance(row, dict):
            raise CptuneError(
                f"{origin}: each line of a .jsonl file of prompts must be a JSON object, a row of the data "
                f'without its answer (e.g. {{"instruction": ...}}); this line is {found}.'
            )
        messages = row.get(config.field_messages)
        if prompter.kind == "chat_template" and isinstance(messages, list) and messages:
            last = messages[-1]
            if isinstance(last, dict) and last.get(config.message_field_role) in config.roles_to_train:
                # A trained message last is the reference answer: the prompt is what precedes it.
                row = {**row, config.field_messages: messages[:-1]}
        yield PromptItem(origin, line, row)


def prompt_items(
    prompter: Prompter, prompt: str | None, prompts: str | Path | None, stdin: Iterable[str] = ()
) -> Iterator[PromptItem]:
    """The prompts: ``--prompt``, each prompt of ``--prompts``, or else each line of ``stdin``.

    ``--prompts`` is a JSON-lines file of rows in the dataset's format without the answer when
    its name ends in ``.jsonl`` or ``.json``, and otherwise a text file of one prompt per line.
    """
    if prompt is not None and prompts is not None:
        raise CptuneError("--prompt and --prompts: give one of them (a prompt, or a file of prompts).")
    if prompt is not None:
        yield PromptItem("--prompt", prompt, prompter.row(prompt))
        return
    if prompts is not None:
        path = Path(prompts)
        if not path.is_file():
            raise CptuneError(
                f"--prompts: '{path}' is not a file; give a text file of prompts, one per line (or a .jsonl "
                "file of rows in the data's format)."
            )
        found = False
        for item in _file_items(prompter, path):
            found = True
            yield item
        if not found:
            raise CptuneError(f"--prompts: '{path}' holds no prompt.")
        return
    for line in stdin:
        line = line.rstrip("\n")
        if line.strip():
            yield PromptItem("the prompt", line, prompter.row(line))


@dataclass(frozen=True)
class Prepared:
    """A prompt turned into token ids (plus the completion and what to score, with ``--score``)."""

    item: PromptItem
    input_ids: list[int]
    scored: list[int] | None = None


def prepare_prompt(
    item: PromptItem, prompter: Prompter, completion: str | None, context: int | None
) -> Prepared:
    """Token ids of a prompt (and completion), checked against the model's context."""
    try:
        if completion is None:
            prepared = Prepared(item, prompter.prompt_ids(item.row))
        else:
            scored = prompter.with_completion(item.row, completion)
            prepared = Prepared(item, scored.input_ids, scored.scored)
    except DataError as err:
        raise CptuneError(f"{item.origin}: {err}") from None
    if completion is not None and not prepared.scored:
        raise CptuneError("--score: the completion has no token to score; give a non-empty completion.")
    if context is not None:
        tokens = len(prepared.input_ids)
        # A prompt needs room for at least one new token; a scored text only has to fit.
        if tokens + (completion is None) > context:
            what = "the prompt" if completion is None else "the prompt with the completion"
            raise CptuneError(
                f"{item.origin}: {what} is {tokens} tokens, but the model's context is {context} tokens "
                "(max_position_embeddings in its config.json). Shorten it."
            )
    return prepared
