"""What every row format shares: the sample it makes, the problem it raises, and reading a row's text fields.

A format (:mod:`cptune.data.formats`, :mod:`cptune.data.alpaca`, :mod:`cptune.data.chat_format`) never
sees the row index or the dataset name; it raises :class:`RowProblem` and the caller (see
:mod:`cptune.data.rows`) turns that into a :class:`~cptune.errors.DataError` naming dataset, row and
field, or counts and skips the row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from cptune.errors import DataError

__all__ = [
    "Formatter",
    "RowProblem",
    "Sample",
    "eos_id",
    "field_problem",
    "leading_special_ids",
    "text_field",
]

_SKIP_HINT = "Fix the row, or set skip_invalid_rows: true to skip such rows (they are counted and reported)."


class RowProblem(Exception):
    """A row that a format cannot use.

    Attributes:
        reason: Short text used to count skipped rows (``field 'output' is missing``).
        detail: The full sentence for an error message.
        skippable: Whether ``skip_invalid_rows`` may skip the row. Problems of the
            setup rather than of the row (a chat template that renders differently
            when a message's text changes) are not.
    """

    def __init__(self, reason: str, detail: str | None = None, *, skippable: bool = True):
        self.reason = reason
        self.detail = detail or f"{reason}. {_SKIP_HINT}"
        self.skippable = skippable
        super().__init__(self.detail)


@dataclass(frozen=True)
class Sample:
    """One tokenized sample; ``labels`` is -100 on tokens that are not trained.

    ``document_lengths``: the documents the sample is made of, end to end (their positions restart
    at 0 each); None for one document. A preference pair is two: prompt + chosen, prompt + rejected
    (:mod:`cptune.data.preference_formats`).
    """

    input_ids: list[int]
    labels: list[int]
    document_lengths: tuple[int, ...] | None = None

    @property
    def documents(self) -> tuple[int, ...]:
        """The length of each document of the sample."""
        return self.document_lengths if self.document_lengths is not None else (len(self.input_ids),)

    @property
    def position_ids(self) -> list[int]:
        """Positions 0..n-1 of each document in turn."""
        return [position for length in self.documents for position in range(length)]

    def truncated(self, length: int) -> Sample:
        """The sample cut to ``length`` tokens, keeping the start of every document.

        One document: its first ``length`` tokens. Two (a preference pair): each side keeps its start;
        a side shorter than half of ``length`` stays whole and the other gets the rest, otherwise
        each gets half, so both sides keep their prompt and as much of their response as fits.
        """
        documents = self.documents
        if sum(documents) <= length:
            return self
        if len(documents) == 1:
            return Sample(self.input_ids[:length], self.labels[:length])
        if len(documents) != 2:
            raise ValueError(f"cannot truncate a sample of {len(documents)} documents")
        first, second = documents
        half = length // 2
        if first <= half:
            kept = (first, length - first)
        elif second <= half:
            kept = (length - second, second)
        else:
            kept = (half, length - half)
        spans = [(0, kept[0]), (first, first + kept[1])]
        return Sample(
            [token for start, stop in spans for token in self.input_ids[start:stop]],
            [label for start, stop in spans for label in self.labels[start:stop]],
            kept,
        )


Formatter = Callable[[Mapping[str, Any]], Sample]


def field_problem(name: str, problem: str) -> RowProblem:
    """The problem of one field of a row: ``field 'output' is missing``."""
    return RowProblem(f"field {name!r} {problem}")


def text_field(row: Mapping[str, Any], name: str, *, required: bool = True) -> str:
    """The text in column ``name``; a missing optional field is empty text."""
    value = row.get(name)
    if value is None:
        if required:
            raise field_problem(name, "is missing")
        return ""
    if not isinstance(value, str):
        raise field_problem(name, f"is a {type(value).__name__}, not text")
    if required and not value.strip():
        raise field_problem(name, "is empty")
    return value


def leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts before a text (its bos, if it adds one).

    Found by comparing an encoding with and without special tokens. Only the leading ones are
    kept: a tokenizer that appends eos to every text must not put an eos between a prompt and
    its response.
    """
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's eos id, which alpaca and completion samples end with.

    Raises:
        DataError: If the tokenizer has no eos token.
    """
    if tokenizer.eos_token_id is None:
        raise DataError(
            "The tokenizer has no eos token, which alpaca and completion rows end with. "
            "Use a tokenizer that defines eos_token (tokenizer_config in the recipe)."
        )
    return int(tokenizer.eos_token_id)
