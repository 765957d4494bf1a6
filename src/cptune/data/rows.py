"""Tokenize every row of one dataset, enforce the length policy and count what was dropped.

Runs the dataset's format over its rows with ``datasets.map`` (batched, with
row indices, optionally in several processes). Each row yields a sample plus a
status; rows that are not kept are counted by status and removed afterwards, so
counting works the same in one process or many. Errors name the dataset, the
row index (0-based, in the order the source yields rows) and the field.

The length policy is ``drop`` or ``truncate`` (``excess_length_strategy``), or ``chunk`` for
completion rows: as Axolotl's ``completion`` type, a text is cut into ``sequence_len`` pieces, each
its own sample (bos in the first, eos in the last), after being cut at
:data:`CHUNKED_TEXT_LIMIT` × ``sequence_len`` tokens.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from cptune.data.formats import Formatter, RowProblem, Sample
from cptune.data.progress import RowProgress
from cptune.data.stats import DatasetStats
from cptune.errors import DataError
from cptune.labels import IGNORE_INDEX, trained_token_count

__all__ = ["CHUNKED_TEXT_LIMIT", "DOCUMENT_STATUSES", "SAMPLE_COLUMNS", "count_tokens", "tokenize_dataset"]

SAMPLE_COLUMNS = ("input_ids", "labels", "position_ids")
"""Columns of a tokenized sample and of a stored row."""

_FEATURES = datasets.Features(
    {
        **{name: datasets.List(datasets.Value("int32")) for name in SAMPLE_COLUMNS},
        "status": datasets.Value("string"),
        "formatted_length": datasets.Value("int32"),
        "is_document": datasets.Value("bool"),
    }
)

CHUNKED_TEXT_LIMIT = 64
"""Completion texts are cut at this many times ``sequence_len`` tokens before they are cut into pieces
(Axolotl's completion strategy tokenizes with ``max_length = 64 * sequence_len``, axolotl 0.21.0
``src/axolotl/prompt_strategies/completion.py``); the cut text has no eos."""

# Statuses of a row; "invalid: <reason>" for skipped rows.
_KEPT = "kept"
_TRUNCATED = "truncated"
_TOO_LONG = "too long"
_NO_TRAINED = "no trained tokens"
_TOO_SHORT = "too short"
_CHUNKED = "chunked"  # a row cut into sequence_len pieces (its documents entry; the pieces follow as _PIECE)
_PIECE = "piece"
_INVALID = "invalid: "

DOCUMENT_STATUSES = (_KEPT, _TRUNCATED, _CHUNKED, _TOO_LONG, _TOO_SHORT, _NO_TRAINED)
"""What the length policy did to a formatted row (the ``status`` of the documents table)."""


def count_tokens(table: pa.Table) -> tuple[int, int]:
    """Tokens and target tokens (see :func:`~cptune.labels.trained_token_count`) of a table of samples."""
    if table.num_rows == 0:
        return 0, 0
    labels = table.column("labels")
    tokens = pc.sum(pc.list_value_length(labels)).as_py() or 0
    trained = pc.sum(pc.not_equal(pc.list_flatten(labels), IGNORE_INDEX).cast(pa.int64())).as_py() or 0
    first_trained = (
        pc.sum(pc.not_equal(pc.list_element(labels, 0), IGNORE_INDEX).cast(pa.int64())).as_py() or 0
    )
    return tokens, trained - first_trained


def _check_columns(dataset: datasets.Dataset, required: Sequence[str], label: str, advice: str) -> None:
    # A column absent from the whole dataset is a setup mistake (a wrong field
    # name), not a bad row: report it once, even with skip_invalid_rows.
    missing = [name for name in required if name not in dataset.column_names]
    if missing:
        raise DataError(
            f"{label}: no column {', '.join(repr(m) for m in missing)} (it has "
            f"{', '.join(repr(c) for c in dataset.column_names)}). {advice}"
        )


def tokenize_dataset(
    dataset: datasets.Dataset,
    formatter: Formatter,
    *,
    label: str,
    key: str,
    required: Sequence[str],
    sequence_len: int,
    excess_length_strategy: Literal["drop", "truncate", "chunk"],
    skip_invalid_rows: bool,
    scratch_dir: str | os.PathLike[str],
    num_proc: int | None = None,
    min_sample_len: int | None = None,
    column_advice: str | None = None,
    progress: RowProgress | None = None,
) -> tuple[pa.Table, DatasetStats, pa.Table]:
    """Turn the rows of one dataset into samples of at most ``sequence_len`` tokens.

    Args:
        dataset: The source rows.
        formatter: From :func:`cptune.data.formats.build_formatter`.
        label: Names the dataset in messages: ``datasets[0] (data/train.jsonl)``.
        key: Its recipe key: ``datasets[0]``.
        required: Columns the format needs.
        sequence_len: Longest sample kept.
        excess_length_strategy: ``drop`` or ``truncate`` longer samples, or ``chunk`` them into
            ``sequence_len`` pieces (completion rows, see the module's docstring).
        skip_invalid_rows: Skip and count malformed rows instead of raising.
        scratch_dir: Folder for the intermediate arrow file (deleted with it).
        num_proc: Worker processes; None or 1 for the current process.
        min_sample_len: Drop samples shorter than this many tokens (Axolotl's key); None keeps all.
        column_advice: What to do when a required column is missing (the end of the message).
        progress: Told of each batch's rows (a log line now and then where no progress bar is drawn).

    Returns:
        An in-memory table with ``input_ids``, ``labels`` and ``position_ids``
        (int32 lists) of the kept samples, in source order; their counts; and the
        documents table: for every row that formatted (skipped rows excepted), in
        source order, ``formatted_length`` (its tokens before the length policy)
        and ``status`` (one of :data:`DOCUMENT_STATUSES`), which ``cptune preprocess
        --report`` draws its length histograms from.

    Raises:
        DataError: For a malformed row (unless skipped), a missing column, or
            when no sample is left.
    """
    advice = column_advice or (
        f"Set the field name keys of {key} (e.g. field_output, field_messages, field) to the columns your data uses."
    )
    _check_columns(dataset, required, label, advice)

    def process(batch: Mapping[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in _FEATURES}
        if progress is not None and indices:
            progress.started(indices[0])

        def emit(
            sample: Sample | None, status: str, formatted_length: int = 0, document: bool = True
        ) -> None:
            out["input_ids"].append(sample.input_ids if sample else [])
            out["labels"].append(sample.labels if sample else [])
            out["position_ids"].append(sample.position_ids if sample else [])
            out["status"].append(status)
            out["formatted_length"].append(formatted_length)
            out["is_document"].append(document)

        def too_short_or_untrained(sample: Sample) -> str | None:
            if min_sample_len is not None and len(sample.input_ids) < min_sample_len:
                return _TOO_SHORT
            if not _every_document_trained(sample):
                return _NO_TRAINED
            return None

        for j, index in enumerate(indices):
            row = {name: column[j] for name, column in batch.items()}
            try:
                sample = formatter(row)
            except RowProblem as problem:
                if skip_invalid_rows and problem.skippable:
                    emit(None, _INVALID + problem.reason, document=False)
                    continue
                raise DataError(f"{label}, row {index}: {problem.detail}") from None
            status = _KEPT
            formatted = len(sample.input_ids)
            if formatted > sequence_len and excess_length_strategy == "chunk":
                emit(None, _CHUNKED, formatted)
                limit = CHUNKED_TEXT_LIMIT * sequence_len
                for start in range(0, min(formatted, limit), sequence_len):
                    stop = min(start + sequence_len, limit)
                    piece = Sample(sample.input_ids[start:stop], sample.labels[start:stop])
                    # A piece of one token (the eos alone) trains nothing: dropped, as Axolotl drops it.
                    if too_short_or_untrained(piece) is None:
                        emit(piece, _PIECE, document=False)
                continue
            if formatted > sequence_len:
                if excess_length_strategy == "drop":
                    emit(None, _TOO_LONG, formatted)
                    continue
                sample, status = sample.truncated(sequence_len), _TRUNCATED
            dropped = too_short_or_untrained(sample)
            if dropped is not None:
                emit(None, dropped, formatted)
                continue
            emit(sample, status, formatted)
        if progress is not None and indices:
            progress.reached(indices[-1] + 1)
        return out

    mapped = dataset.map(
        process,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,
        features=_FEATURES,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        cache_file_name=os.path.join(os.fspath(scratch_dir), f"{key}.arrow"),
        # An explicit fingerprint: datasets would otherwise hash the closure
        # (tokenizer included) for a cache cptune does not use.
        new_fingerprint=f"cptune-{key}",
        load_from_cache_file=False,
        desc=f"Tokenizing {label}",
    )
    statuses = mapped.data.table.column("status").to_pylist()
    counts = Counter(statuses)
    keep = [i for i, status in enumerate(statuses) if status in (_KEPT, _TRUNCATED, _PIECE)]
    table = mapped.data.table.select(list(SAMPLE_COLUMNS)).take(pa.array(keep, type=pa.int64()))
    table = table.combine_chunks()
    is_document = mapped.data.table.column("is_document").to_pylist()
    formatted = [i for i, document in enumerate(is_document) if document]
    documents = mapped.data.table.select(["formatted_length", "status"]).take(
        pa.array(formatted, type=pa.int64())
    )
    tokens, trained = count_tokens(table)
    stats = DatasetStats(
        label=label,
        rows_in=len(dataset),
        rows_out=table.num_rows,
        skipped={s[len(_INVALID) :]: n for s, n in sorted(counts.items()) if s.startswith(_INVALID)},
        dropped_too_long=counts[_TOO_LONG],
        truncated=counts[_TRUNCATED],
        chunked=counts[_CHUNKED],
        dropped_no_trained_tokens=counts[_NO_TRAINED],
        dropped_too_short=counts[_TOO_SHORT],
        tokens=tokens,
        trained_tokens=trained,
    )
    if table.num_rows == 0:
        raise DataError(
            f"{label}: no sample is left of its {len(dataset)} rows ({_describe_losses(stats)}). "
            "Check the field names and the data, raise sequence_len, or set excess_length_strategy: truncate."
        )
    return table, stats, documents.combine_chunks()


def _every_document_trained(sample: Sample) -> bool:
    """Each document of the sample has a target (both sides of a preference pair, or the one document)."""
    start = 0
    for length in sample.documents:
        if trained_token_count(sample.labels[start : start + length]) == 0:
            return False
        start += length
    return True


def _describe_losses(stats: DatasetStats) -> str:
    parts = [
        f"{stats.dropped_too_long} longer than sequence_len",
        f"{stats.dropped_no_trained_tokens} without trained tokens",
        *([f"{stats.dropped_too_short} shorter than min_sample_len"] if stats.dropped_too_short else []),
        *(f"{n} skipped: {reason}" for reason, n in stats.skipped.items()),
    ]
    return ", ".join(parts)
