"""Find and load the rows of one ``datasets:`` entry of a recipe.

A ``path`` is, in this order: a local data file (json, jsonl, csv, tsv,
parquet, arrow; the text formats also compressed, :mod:`cptune.data.compression`), a local folder written by ``Dataset.save_to_disk`` /
``DatasetDict.save_to_disk``, a local folder of data files, or a Hugging Face
hub dataset id. Relative local paths are relative to the working directory.
A file's format comes from its extension, or from ``ds_type`` (Axolotl's key: json,
csv, parquet, arrow, or text, one row per line in a ``text`` column).
Resolving (which files, which loader) is kept apart from loading so that the
preprocess cache can fingerprint the exact files that will be read.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import datasets

from cptune.config.data import DatasetConfig
from cptune.data.compression import COMPRESSIONS, compression, format_suffix, open_decompressed
from cptune.errors import DataError, RecipeProblem

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe

__all__ = [
    "DATA_FILE_BUILDERS",
    "ResolvedSource",
    "load_source",
    "resolve_source",
    "source_label",
    "source_problems",
]

DATA_FILE_BUILDERS: dict[str, tuple[str, dict[str, str]]] = {
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".ndjson": ("json", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"sep": "\t"}),
    ".parquet": ("parquet", {}),
    ".arrow": ("arrow", {}),
}
"""Local data file extensions cptune reads, and the ``datasets`` builder (with options) for each."""

# Builders that read text: their files must be UTF-8 (the json reader takes other bytes and
# fails later, deep inside the tokenizing loop, with a traceback). Only these may be compressed
# (parquet and arrow compress inside the file).
_TEXT_BUILDERS = ("json", "csv", "text")


def _readable(path: Path) -> bool:
    builder = DATA_FILE_BUILDERS.get(format_suffix(path))
    return builder is not None and (compression(path) is None or builder[0] in _TEXT_BUILDERS)


def _supported() -> str:
    text = [s for s, (builder, _) in DATA_FILE_BUILDERS.items() if builder in _TEXT_BUILDERS]
    return (
        f"{', '.join(DATA_FILE_BUILDERS)}, and {', '.join(text)} compressed "
        f"({', '.join(COMPRESSIONS)}, e.g. rows.jsonl.zst)"
    )


# A hub id is "name" or "owner/name"; anything else that does not exist locally
# is reported as a missing local path rather than sent to the hub.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def source_label(key: str, index: int, config: DatasetConfig) -> str:
    """How messages name a dataset: ``datasets[0] (data/train.jsonl)``."""
    return f"{key}[{index}] ({config.path})"


@dataclass(frozen=True)
class ResolvedSource:
    """Where the rows of one dataset come from, decided before anything is read.

    Attributes:
        kind: ``files`` (local data files), ``saved`` (a ``save_to_disk`` folder) or ``hub``.
        label: How messages name the dataset (see :func:`source_label`).
        key: Recipe key of the list holding it, with index: ``datasets[0]``.
        files: Local files whose bytes define the rows (for ``files`` and ``saved``).
        builder: ``datasets`` builder for ``files`` (json, csv, parquet, arrow).
        builder_kwargs: Extra options of that builder (the tsv separator).
    """

    kind: Literal["files", "saved", "hub"]
    label: str
    key: str
    files: tuple[Path, ...] = ()
    builder: str | None = None
    builder_kwargs: dict[str, str] = field(default_factory=dict)


def _data_files(config: DatasetConfig) -> tuple[str, ...]:
    if config.data_files is None:
        return ()
    if isinstance(config.data_files, str):
        return (config.data_files,)
    return tuple(config.data_files)


def _is_saved_dataset(folder: Path) -> bool:
    # save_to_disk writes state.json + dataset_info.json (Dataset) or
    # dataset_dict.json (DatasetDict); a folder of raw files has neither.
    return (folder / datasets.config.DATASETDICT_JSON_FILENAME).is_file() or (
        (folder / datasets.config.DATASET_STATE_JSON_FILENAME).is_file()
        and (folder / datasets.config.DATASET_INFO_FILENAME).is_file()
    )


def _builder_for(files: list[Path], label: str, key: str, ds_type: str | None) -> tuple[str, dict[str, str]]:
    if ds_type is not None:
        # Axolotl's ds_type names the loader whatever the files are called; a file whose extension
        # names the same format keeps its options (the tsv separator).
        suffixes = {format_suffix(f) for f in files}
        if len(suffixes) == 1:
            builder = DATA_FILE_BUILDERS.get(suffixes.pop())
            if builder is not None and builder[0] == ds_type:
                return ds_type, dict(builder[1])
        return ds_type, {}
    unknown = sorted({format_suffix(f) + (compression(f) or "") or f.name for f in files if not _readable(f)})
    if unknown:
        raise DataError(
            f"{label}: cannot read files of type {', '.join(unknown)}. Supported: {_supported()}. "
            f"Convert the files, name their format with {key}.ds_type, or select readable ones with "
            f"{key}.data_files."
        )
    # One builder per dataset entry: json and csv rows cannot share a loader call.
    builders = {(DATA_FILE_BUILDERS[format_suffix(f)][0], format_suffix(f) == ".tsv") for f in files}
    if len(builders) != 1:
        raise DataError(
            f"{label}: the files mix formats ({', '.join(sorted({format_suffix(f) for f in files}))}). "
            f"Put one format per dataset entry, or select files with {key}.data_files."
        )
    name, kwargs = DATA_FILE_BUILDERS[format_suffix(files[0])]
    return name, dict(kwargs)


def _folder_files(folder: Path, config: DatasetConfig, label: str, key: str) -> list[Path]:
    patterns = _data_files(config)
    if not patterns:
        found = sorted(
            p
            for p in folder.rglob("*")
            if p.is_file()
            and _readable(p)
            and (config.ds_type is None or DATA_FILE_BUILDERS[format_suffix(p)][0] == config.ds_type)
            and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        )
        if not found:
            what = "data files" if config.ds_type is None else f"{config.ds_type} files by their extension"
            raise DataError(
                f"{label}: the folder holds no {what} ({_supported()}). "
                f"Point {key}.path at a data file or a folder of them, or select the files with {key}.data_files."
            )
        return found
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(
            Path(m) for m in glob.glob(str(folder / pattern), recursive=True) if Path(m).is_file()
        )
        if not matches:
            raise DataError(f"{label}: {key}.data_files entry {pattern!r} matches no file in {folder}.")
        files.extend(m for m in matches if m not in files)
    return files


def resolve_source(config: DatasetConfig, key: str, index: int) -> ResolvedSource:
    """Decide where the rows of ``config`` come from, without reading them.

    Args:
        config: One entry of ``datasets`` or ``test_datasets``.
        key: ``"datasets"`` or ``"test_datasets"`` (used in messages).
        index: Position of the entry in that list.

    Returns:
        The resolved source.

    Raises:
        DataError: If a local path does not exist or cannot be read, a folder holds no
            readable files, or ``data_files`` matches nothing.
    """
    label = source_label(key, index, config)
    entry = f"{key}[{index}]"
    path = Path(os.path.expanduser(config.path))
    if path.is_file():
        if config.data_files is not None:
            raise DataError(
                f"{label}: {entry}.data_files selects files inside a folder; {entry}.path is a file. Remove data_files."
            )
        name, kwargs = _builder_for([path], label, entry, config.ds_type)
        return _check_access(ResolvedSource("files", label, entry, (path,), name, kwargs))
    if path.is_dir():
        if _is_saved_dataset(path):
            files = tuple(sorted(p for p in path.rglob("*") if p.is_file()))
            return _check_access(ResolvedSource("saved", label, entry, files))
        files_list = _folder_files(path, config, label, entry)
        name, kwargs = _builder_for(files_list, label, entry, config.ds_type)
        return _check_access(ResolvedSource("files", label, entry, tuple(files_list), name, kwargs))
    looks_local = (
        config.path.startswith((".", "/", "~"))
        or format_suffix(Path(config.path)) in DATA_FILE_BUILDERS
        or not _HUB_ID.match(config.path)
    )
    if looks_local:
        raise DataError(
            f"{label}: {entry}.path {config.path!r} does not exist (relative paths are read from "
            f"{os.getcwd()}). Fix {entry}.path, or use a hub dataset id such as 'owner/name'."
        )
    return ResolvedSource("hub", label, entry)


def _check_access(source: ResolvedSource) -> ResolvedSource:
    # A file the user may not read exists (is_file) but fails only when the loader opens it, inside
    # the data preparation of every command; say so while resolving, with the file's name.
    for path in source.files:
        if not os.access(path, os.R_OK):
            raise DataError(
                f"{source.label}: '{path}' cannot be read (no read permission for this user). "
                f"Make it readable (chmod +r), or point {source.key}.path at a copy you can read."
            )
    return source


def source_problems(recipe: Recipe) -> list[RecipeProblem]:
    """Every ``datasets`` / ``test_datasets`` entry whose local data is missing or unreadable.

    Reads no rows and contacts no hub (a hub id is checked when it is loaded); cheap enough for
    ``cptune validate`` to run before anything heavy, so that it reports these with the other problems.
    """
    problems = []
    for key in ("datasets", "test_datasets"):
        for index, config in enumerate(getattr(recipe, key) or ()):
            try:
                resolve_source(config, key, index)
            except DataError as err:
                problems.append(RecipeProblem("", str(err)))
    return problems


def _first_non_utf8_line(path: Path) -> int | None:
    """The number of the first line of ``path`` (decompressed) that is not UTF-8, or None."""
    with open_decompressed(path) as lines:
        for number, line in enumerate(lines, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return None


def _check_utf8(source: ResolvedSource) -> None:
    if source.kind != "files" or source.builder not in _TEXT_BUILDERS:
        return
    for path in source.files:
        line = _first_non_utf8_line(path)
        if line is not None:
            raise DataError(
                f"{source.label}: '{path}' is not UTF-8 text (line {line}). Save the file as UTF-8 "
                "(e.g. `iconv -f latin1 -t utf-8`), or fix the bytes on that line."
            )


def _split_name(split: str) -> str:
    # "train[:10%]" selects from the split "train".
    return split.split("[", 1)[0]


def _describe(error: BaseException) -> str:
    # datasets wraps reader errors ("An error occurred while generating the
    # dataset"); the innermost cause is the one that says what is wrong.
    text = f"{type(error).__name__}: {error}"
    inner = error.__cause__ or error.__context__
    depth = 0
    while inner is not None and depth < 5:
        error, inner, depth = inner, inner.__cause__ or inner.__context__, depth + 1
    if depth:
        text += f" (caused by {type(error).__name__}: {error})"
    return text


def load_source(
    source: ResolvedSource,
    config: DatasetConfig,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Load the rows of a resolved source as one ``datasets.Dataset``.

    Args:
        source: From :func:`resolve_source`.
        config: The same dataset entry (split, hub name, revision, data_files).
        cache_dir: Where ``datasets`` may write its arrow conversion of local
            files; hub downloads always use the user's Hugging Face cache.
        num_proc: Processes for reading local files.

    Returns:
        A non-empty dataset.

    Raises:
        DataError: If the data cannot be read (a text file that is not UTF-8 included), the
            split does not exist, or it has no rows.
    """
    if source.kind == "files" and all(f.stat().st_size == 0 for f in source.files):
        raise DataError(
            f"{source.label}: the data files are empty. Point {source.key}.path at data with rows."
        )
    _check_utf8(source)
    try:
        if source.kind == "files":
            loaded: Any = datasets.load_dataset(
                source.builder,
                data_files={_split_name(config.split): [str(f) for f in source.files]},
                split=config.split,
                cache_dir=None if cache_dir is None else str(cache_dir),
                num_proc=num_proc,
                **source.builder_kwargs,
            )
        elif source.kind == "saved":
            loaded = datasets.load_from_disk(os.path.expanduser(config.path))
            if isinstance(loaded, datasets.DatasetDict):
                split = _split_name(config.split)
                if split not in loaded:
                    raise DataError(
                        f"{source.label}: the saved dataset has no split {split!r} (it has "
                        f"{', '.join(sorted(loaded))}). Set {source.key}.split to one of them."
                    )
                loaded = loaded[split]
        else:
            data_files = _data_files(config)
            loaded = datasets.load_dataset(
                config.path,
                name=config.name,
                split=config.split,
                data_files=list(data_files) or None,
                revision=config.revision,
                num_proc=num_proc,
            )
    except DataError:
        raise
    except ValueError as error:
        if _selects_no_rows(error):
            raise _no_rows(source, config) from None
        raise _cannot_load(source, config, error) from error
    except Exception as error:  # every loader failure becomes one user-facing message
        raise _cannot_load(source, config, error) from error
    if not isinstance(loaded, datasets.Dataset):
        raise DataError(
            f"{source.label}: loading gave a {type(loaded).__name__}, not one split; set {source.key}.split."
        )
    if len(loaded) == 0:
        raise _no_rows(source, config)
    return loaded


def _selects_no_rows(error: ValueError) -> bool:
    # datasets refuses to build a split that holds no rows (arrow_reader.py, ArrowReader.read): a CSV
    # file with only its header, a JSON file holding [], a slice such as train[:0].
    return "corresponds to no data" in str(error)


def _no_rows(source: ResolvedSource, config: DatasetConfig) -> DataError:
    return DataError(
        f"{source.label}: split {config.split!r} has no rows (the data holds none, or the split's slice "
        f"selects none). Point {source.key}.path at data with rows."
    )


def _cannot_load(source: ResolvedSource, config: DatasetConfig, error: BaseException) -> DataError:
    what = (
        f"a hub dataset id (no local file or folder {config.path!r} exists either)"
        if source.kind == "hub"
        else "local data"
    )
    return DataError(
        f"{source.label}: could not load it as {what}: {_describe(error)}. "
        f"Check {source.key}.path, .split, .name and .data_files."
    )
