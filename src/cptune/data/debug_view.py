"""``cptune preprocess --debug``: prepared rows decoded, with the tokens that are trained marked.

The marking comes from the labels the training collator builds
(:class:`~cptune.data.collator.PackedCollator`), not from the formats: what is
shown is what the loss sees. ``labels[i]`` is the label of token i itself and
``shift_labels[i]`` the token position i is trained to predict; so token i is
*trained* (the loss makes the model predict it) exactly when
``shift_labels[i - 1]`` is not -100, that is when ``labels[i]`` is not -100 and
token i is not the first of its document (nothing before it in its document
predicts it). Packed rows are shown document by document: documents never
attend to each other and never predict each other's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from cptune.data.collator import PackedCollator
from cptune.labels import IGNORE_INDEX, REJECTED, document_starts

__all__ = ["LEGEND", "DebugRow", "debug_rows", "format_rows", "rows_json"]

LEGEND = (
    "Trained tokens are marked [[like this]] (in colour on a terminal): the loss trains the model to "
    "predict them. Token i is marked when the collator's shift_labels[i-1] is not -100, i.e. its "
    "labels[i] is not -100 and it is not the first token of its document (nothing before it in its "
    "document predicts it). Unmarked tokens are context only. Each document of a packed row starts on "
    "a '── document' line; documents never attend to each other."
)

JSON_LEGEND = {
    "input_ids": "token ids of the row as the collator batches it (padding included)",
    "pieces": "each token decoded on its own",
    "labels": "the collator's labels: labels[i] is the label of token i itself (-100: not trained)",
    "targets": "the collator's shift_labels: targets[i] is the token position i is trained to predict "
    "(-100: none); targets[i] == labels[i+1] inside a document",
    "trained": "trained[i] is true when the loss trains the model to predict token i (targets[i-1] != -100)",
    "position_ids": "positions; they restart at 0 where a document starts",
    "document": "document number of each token; padding, if any, is a document of its own",
    "sequence_ids": "preference pairs (rl) only: 2 x pair + side of each token (side 0: chosen, 1: rejected), "
    "-1 on padding; null otherwise",
}

_GREEN, _DIM, _CYAN, _RESET = "\x1b[1;32m", "\x1b[2m", "\x1b[36m", "\x1b[0m"


@dataclass(frozen=True)
class DebugRow:
    """One stored row as the collator batches it, with what each token is trained on.

    Attributes:
        index: The row's index in its split.
        input_ids: Token ids, padding included.
        labels: The collator's ``labels`` (label of each token itself).
        targets: The collator's ``shift_labels`` (token each position predicts, -100 for none).
        position_ids: The collator's positions.
        document: Document number of each token (0-based; padding is its own document).
        trained: Whether the loss trains the model to predict each token.
        padding: Pad tokens the collator appended.
        sequence_ids: Preference rows (``rl``): the collator's ``sequence_ids``, ``2·pair + side`` of each
            token (:func:`~cptune.labels.pair_sequence_ids`); None for other rows.
    """

    index: int
    input_ids: list[int]
    labels: list[int]
    targets: list[int]
    position_ids: list[int]
    document: list[int]
    trained: list[bool]
    padding: int
    sequence_ids: list[int] | None = None

    @property
    def real_tokens(self) -> int:
        return len(self.input_ids) - self.padding

    def document_spans(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of every real document, in order."""
        spans: list[tuple[int, int]] = []
        for i in range(self.real_tokens):
            if i == 0 or self.document[i] != self.document[i - 1]:
                spans.append((i, i + 1))
            else:
                spans[-1] = (spans[-1][0], i + 1)
        return spans


def debug_rows(rows: Any, collator: PackedCollator, indices: Sequence[int]) -> list[DebugRow]:
    """The rows at ``indices`` of a prepared split, each collated alone as training collates it.

    Args:
        rows: A prepared split (``datasets.Dataset``) or a list of rows with ``input_ids``,
            ``labels`` and ``position_ids``.
        collator: The training collator (:meth:`PackedCollator.for_recipe`).
        indices: Which rows.
    """
    # A stored pair row shown as one row even where training lays its sides out as a row each: the marks
    # (targets within each document) are the same either way.
    collator = replace(collator, pair_sides_in_own_rows=False)
    out = []
    for index in indices:
        row = rows[index]
        batch = collator([row])
        starts = document_starts(batch["position_ids"])[0]
        targets = batch["shift_labels"][0].tolist()
        out.append(
            DebugRow(
                index=index,
                input_ids=batch["input_ids"][0].tolist(),
                labels=batch["labels"][0].tolist(),
                targets=targets,
                position_ids=batch["position_ids"][0].tolist(),
                document=(starts.cumsum(0) - 1).tolist(),
                trained=[False] + [target != IGNORE_INDEX for target in targets[:-1]],
                padding=batch["input_ids"].shape[1] - len(row["input_ids"]),
                sequence_ids=batch["sequence_ids"][0].tolist() if "sequence_ids" in batch else None,
            )
        )
    return out


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _marked_text(row: DebugRow, start: int, stop: int, tokenizer: Any, colour: bool) -> str:
    # Runs of tokens with the same marking are decoded together, so that words split into
    # several tokens read as words.
    parts, run_start = [], start
    for i in range(start + 1, stop + 1):
        if i < stop and row.trained[i] == row.trained[run_start]:
            continue
        text = _decode(tokenizer, row.input_ids[run_start:i])
        if row.trained[run_start]:
            parts.append(f"{_GREEN}{text}{_RESET}" if colour else f"[[{text}]]")
        else:
            parts.append(text)
        run_start = i
    return "".join(parts)


def _pair_side(row: DebugRow, start: int) -> str:
    """`` (pair 1, chosen)`` for a document of a preference row, else nothing."""
    if row.sequence_ids is None:
        return ""
    pair, side = divmod(row.sequence_ids[start], 2)
    return f" (pair {pair + 1}, {'rejected' if side == REJECTED else 'chosen'})"


def format_rows(rows: Sequence[DebugRow], tokenizer: Any, *, split: str, total: int, colour: bool) -> str:
    """The rows decoded, documents apart, trained tokens marked; a legend first.

    Args:
        rows: From :func:`debug_rows`.
        tokenizer: Decodes the tokens.
        split: ``train`` or ``eval``, for the headings.
        total: Rows in the split, for the headings.
        colour: ANSI colour (for a terminal) instead of ``[[...]]``.
    """

    def rule(text: str) -> str:
        return f"{_CYAN}{text}{_RESET}" if colour else text

    legend = LEGEND.replace("[[like this]]", f"{_GREEN}like this{_RESET}") if colour else LEGEND
    lines = [legend]
    for row in rows:
        spans = row.document_spans()
        lines += [
            "",
            rule(
                f"=== {split} row {row.index} of {total}: {row.real_tokens} tokens, {len(spans)} "
                f"document{'s' * (len(spans) != 1)}, {sum(row.trained)} trained ==="
            ),
        ]
        for number, (start, stop) in enumerate(spans, 1):
            trained = sum(row.trained[start:stop])
            lines.append(
                rule(
                    f"── document {number} of {len(spans)}{_pair_side(row, start)}: tokens {start}-{stop - 1} "
                    f"({stop - start} tokens, {trained} trained) ──"
                )
            )
            lines.append(_marked_text(row, start, stop, tokenizer, colour))
        if row.padding:
            pad = _decode(tokenizer, row.input_ids[row.real_tokens : row.real_tokens + 1])
            lines.append(
                rule(
                    f"── padding: {row.padding} × {pad} (pad_to_sequence_len), its own document, never trained ──"
                )
            )
    return "\n".join(lines)


def rows_json(rows: Sequence[DebugRow], tokenizer: Any, *, split: str, total: int) -> dict[str, Any]:
    """The rows as JSON-ready data: per token its id, text, label, target, position and document."""
    return {
        "legend": JSON_LEGEND,
        "split": split,
        "rows_in_split": total,
        "rows": [
            {
                **asdict(row),
                "real_tokens": row.real_tokens,
                "pieces": [_decode(tokenizer, [token]) for token in row.input_ids],
            }
            for row in rows
        ],
    }
