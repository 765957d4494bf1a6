"""Check the first rows of each local data file against the dataset's type, for ``cptune validate``.

``cptune train`` meets a row its dataset type cannot use only while it prepares the data. ``cptune
validate`` reads the first :data:`FIRST_ROWS` rows of every local data file (without ``datasets``'
conversion of the whole file into its cache), runs the dataset's format on them (the formatter
``cptune train`` uses, :func:`cptune.data.formats.dataset_formatter`) and reports each row it cannot
use (the file, the row and what is wrong), a line that does not parse, and a column the type needs
that the rows lack. Rows further down are checked only by ``cptune preprocess`` and ``cptune train``.
Hub datasets are not read here (that would download them).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cptune.config.data import DatasetConfig
from cptune.data.compression import open_decompressed
from cptune.data.formats import (
    Formatter,
    RowProblem,
    dataset_formatter,
    missing_columns_advice,
    required_columns,
)
from cptune.data.sources import ResolvedSource, resolve_source
from cptune.errors import CptuneError, RecipeProblem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from cptune.config.recipe import Recipe

__all__ = ["FIRST_ROWS", "first_row_problems", "read_first_rows"]

FIRST_ROWS = 10
"""Rows read from the start of each data file."""

# A JSON file that is one array (not JSON lines) must be parsed whole to give its first rows; a
# bigger one is left to preprocess and train.
_WHOLE_JSON_LIMIT = 64 * 2**20


@dataclass(frozen=True)
class FileRow:
    """One row read from a data file: its 0-based index in the file, and its line where lines are rows."""

    index: int
    row: dict[str, Any]
    line: int | None = None

    @property
    def where(self) -> str:
        return f"row {self.index}" + (f" (line {self.line})" if self.line is not None else "")


class UnreadableRow(Exception):
    """A row that does not parse as the file's format; ``where`` names it as :attr:`FileRow.where` does."""

    def __init__(self, where: str, reason: str):
        self.where, self.reason = where, reason
        super().__init__(f"{where}: {reason}")


def first_row_problems(
    recipe: Recipe, tokenizer: PreTrainedTokenizerBase, count: int = FIRST_ROWS
) -> list[RecipeProblem]:
    """Every problem in the first ``count`` rows of each local data file of ``datasets`` and ``test_datasets``.

    Entries whose path does not resolve are skipped (:func:`cptune.data.sources.source_problems`
    reports them); so are hub datasets. A row problem that ``skip_invalid_rows`` would skip is not one.
    """
    problems = []
    for key in ("datasets", "test_datasets"):
        for index, config in enumerate(getattr(recipe, key) or ()):
            try:
                source = resolve_source(config, key, index)
            except CptuneError:
                continue
            if source.kind == "hub":
                continue
            problems += _entry_problems(recipe, tokenizer, config, source, count)
    return problems


def _entry_problems(
    recipe: Recipe,
    tokenizer: PreTrainedTokenizerBase,
    config: DatasetConfig,
    source: ResolvedSource,
    count: int,
) -> list[RecipeProblem]:
    try:
        formatter = dataset_formatter(recipe, config, tokenizer, source.label)
    except CptuneError as err:  # the tokenizer cannot serve this type (no chat template, ...)
        return [RecipeProblem("", str(err))]
    files: list[Path | None] = [None] if source.kind == "saved" else list(source.files)
    problems = []
    for path in files:
        # One file per dataset needs no name beyond the dataset's label; several do.
        where = source.label if len(files) == 1 else f"{source.label}, file '{path}'"
        rows: list[FileRow] = []
        unreadable = None
        try:
            # The rows before one that does not parse are checked too.
            rows.extend(_saved_rows(config, count) if path is None else read_first_rows(path, source, count))
        except UnreadableRow as bad:
            unreadable = RecipeProblem("", f"{where}, {bad.where}: {bad.reason}")
        problems += _row_problems(recipe, config, source, formatter, where, rows)
        if unreadable is not None:
            problems.append(unreadable)
    return problems


def _row_problems(
    recipe: Recipe,
    config: DatasetConfig,
    source: ResolvedSource,
    formatter: Formatter,
    where: str,
    rows: list[FileRow],
) -> list[RecipeProblem]:
    if not rows:
        return []
    columns = {name for file_row in rows for name, value in file_row.row.items() if value is not None}
    missing = [name for name in required_columns(config) if name not in columns]
    if missing:
        return [
            RecipeProblem(
                "",
                f"{where}: its first {len(rows)} rows have no column {', '.join(repr(m) for m in missing)} "
                f"(they have {', '.join(repr(c) for c in sorted(columns))}). "
                f"{missing_columns_advice(config, source.key)}",
            )
        ]
    problems = []
    for file_row in rows:
        try:
            formatter(file_row.row)
        except RowProblem as problem:
            if not (recipe.skip_invalid_rows and problem.skippable):
                problems.append(RecipeProblem("", f"{where}, {file_row.where}: {problem.detail}"))
    return problems


def read_first_rows(path: Path, source: ResolvedSource, count: int = FIRST_ROWS) -> Iterator[FileRow]:
    """The first ``count`` rows of one data file, as ``datasets`` would give them to the formatter.

    Raises:
        UnreadableRow: a row (a line of JSON lines) does not parse.
    """
    builder = source.builder
    if builder == "json":
        yield from _json_rows(path, count)
    elif builder == "csv":
        yield from _csv_rows(path, count, source.builder_kwargs.get("sep", ","))
    elif builder == "text":
        with io.TextIOWrapper(open_decompressed(path), encoding="utf-8", errors="replace") as lines:
            for index, line in zip(range(count), lines, strict=False):
                yield FileRow(index, {"text": line.rstrip("\r\n")}, line=index + 1)
    elif builder == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=count):
            yield from (FileRow(i, row) for i, row in enumerate(batch.to_pylist()))
            break
    elif builder == "arrow":
        yield from (FileRow(i, row) for i, row in enumerate(_arrow_rows(path, count)))


def _json_rows(path: Path, count: int) -> Iterator[FileRow]:
    """JSON lines, or one JSON document (an array of rows, or an object of columns), as datasets reads them.

    datasets reads a json file as JSON lines and, when that fails, as one document.
    """
    index = 0
    with io.TextIOWrapper(open_decompressed(path), encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if index == count:
                return
            if not line.strip():  # datasets skips blank lines
                continue
            try:
                row = json.loads(line.strip())
            except json.JSONDecodeError as err:
                if index == 0:  # not JSON lines at all: one document over several lines?
                    document = _whole_document(path)
                    if document is not None:
                        yield from _document_rows(document, count)
                        return
                raise UnreadableRow(
                    f"row {index} (line {number})",
                    f"not valid JSON ({err.msg}, column {err.colno}). Each line of a JSON lines file must be "
                    "one JSON object; fix the line.",
                ) from None
            if not isinstance(row, dict):
                if index == 0 and isinstance(row, list):  # an array of rows on one line
                    yield from _document_rows(row, count)
                    return
                raise UnreadableRow(
                    f"row {index} (line {number})",
                    f"is a JSON {type(row).__name__}, not an object of columns; fix the line.",
                )
            yield FileRow(index, row, line=number)
            index += 1


def _whole_document(path: Path) -> Any:
    """The file as one JSON document, or None when it is not one (or too big to read here)."""
    if path.stat().st_size > _WHOLE_JSON_LIMIT:
        return None
    try:
        with open_decompressed(path) as data:
            return json.loads(data.read())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _document_rows(document: Any, count: int) -> Iterator[FileRow]:
    # datasets reads an array of objects as rows, an array of strings as rows of "text", and an
    # object (over several lines) as one row.
    rows = document if isinstance(document, list) else [document]
    for index, row in enumerate(rows[:count]):
        if isinstance(row, str):
            row = {"text": row}
        if not isinstance(row, dict):
            raise UnreadableRow(f"row {index}", f"is a JSON {type(row).__name__}, not an object of columns")
        yield FileRow(index, row)


def _csv_rows(path: Path, count: int, sep: str) -> Iterator[FileRow]:
    # datasets reads csv with pandas; so do these rows (same types: numbers, NaN for an empty cell).
    import pandas as pd

    try:
        frame = pd.read_csv(open_decompressed(path), sep=sep, nrows=count)
    except (ValueError, csv.Error) as err:  # pandas' ParserError is a ValueError
        raise UnreadableRow("the first rows", f"not valid CSV ({err})") from None
    for index, row in enumerate(frame.to_dict(orient="records")):
        # A data line's number: the header is line 1 (a cell with a line break would shift it).
        yield FileRow(index, {k: None if _is_nan(v) else v for k, v in row.items()}, line=index + 2)


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and value != value


def _arrow_rows(path: Path, count: int) -> list[dict[str, Any]]:
    import pyarrow as pa

    # datasets' arrow files are IPC streams; other writers use the IPC file format.
    try:
        reader: Any = pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        return reader.get_batch(0).slice(0, count).to_pylist() if reader.num_record_batches else []
    for batch in reader:
        return batch.slice(0, count).to_pylist()
    return []


def _saved_rows(config: DatasetConfig, count: int) -> Iterator[FileRow]:
    """The first rows of a ``save_to_disk`` folder (memory-mapped: nothing is converted)."""
    import os

    import datasets

    loaded: Any = datasets.load_from_disk(os.path.expanduser(config.path))
    if isinstance(loaded, datasets.DatasetDict):
        split = config.split.split("[", 1)[0]
        if split not in loaded:
            return  # preprocess and train say which splits it has
        loaded = loaded[split]
    for index, row in enumerate(loaded.select(range(min(count, len(loaded))))):
        yield FileRow(index, dict(row))
