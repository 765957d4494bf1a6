"""Prepare a recipe's data: load, tokenize, deduplicate, split, pack, and cache the result.

:func:`prepare_datasets` is what ``cptune preprocess`` and ``cptune train`` call.
It fingerprints the inputs, reuses ``dataset_prepared_path/<fingerprint>/``
when a finished copy exists, and otherwise builds it (one process at a time,
see :mod:`cptune.data.cache`). Each stored row has ``input_ids``, ``labels``
and ``position_ids`` (int lists of at most ``sequence_len`` tokens; with
packing, positions restart at 0 for every sample in the row). Beside them,
``documents.arrow`` records every formatted row's length before the length
policy and what the policy did to it (see :func:`load_documents`).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import InMemoryTable
from transformers import PreTrainedTokenizerBase

from cptune.config.data import DatasetConfig
from cptune.config.recipe import Recipe
from cptune.console import draws_progress_bars
from cptune.data.cache import build_once, compute_fingerprint, is_built
from cptune.data.dedup import drop_duplicates
from cptune.data.formats import dataset_formatter, missing_columns_advice, required_columns
from cptune.data.packing import first_fit_decreasing, pack_table, packing_efficiency
from cptune.data.progress import RowProgress
from cptune.data.rows import count_tokens, tokenize_dataset
from cptune.data.sources import ResolvedSource, load_source, resolve_source
from cptune.data.stats import DatasetStats, PrepStats, SplitStats
from cptune.errors import DataError

__all__ = [
    "PreparedData",
    "cached_stats",
    "highest_token_id",
    "load_documents",
    "load_prepared",
    "prepare_datasets",
    "resolve_sources",
]

logger = logging.getLogger(__name__)

_STATS_FILE = "stats.json"
_DOCUMENTS_FILE = "documents.arrow"
_TRAIN, _EVAL = "train", "eval"


@dataclass(frozen=True)
class PreparedData:
    """The prepared data of a recipe.

    Attributes:
        train: Training rows (``input_ids``, ``labels``, ``position_ids``).
        eval: Evaluation rows, or None when the recipe has no evaluation data.
        path: The cache folder they are stored in.
        stats: What preparation did (see :meth:`PrepStats.format`).
    """

    train: datasets.Dataset
    eval: datasets.Dataset | None
    path: Path
    stats: PrepStats


def highest_token_id(prepared: PreparedData, ignoring: Collection[int] = ()) -> int | None:
    """The highest token id in the prepared rows (train and eval), ids in ``ignoring`` left out; None when they
    hold no other token."""
    highest: int | None = None
    for dataset in (prepared.train, prepared.eval):
        if dataset is None or len(dataset) == 0:
            continue
        ids = pc.list_flatten(dataset.data.table.column("input_ids"))
        value = pc.max(ids).as_py()
        if value in ignoring:  # rare: filtering copies every id
            left_out = pa.array(sorted(ignoring), type=ids.type)
            value = pc.max(pc.filter(ids, pc.invert(pc.is_in(ids, value_set=left_out)))).as_py()
        if value is not None:
            highest = value if highest is None else max(highest, value)
    return highest


def resolve_sources(recipe: Recipe) -> list[tuple[str, DatasetConfig, ResolvedSource]]:
    """Resolve every entry of ``datasets`` and ``test_datasets`` (see :func:`resolve_source`)."""
    entries = [("datasets", i, c) for i, c in enumerate(recipe.datasets)]
    entries += [("test_datasets", i, c) for i, c in enumerate(recipe.test_datasets or ())]
    return [(key, config, resolve_source(config, key, index)) for key, index, config in entries]


def prepare_datasets(
    recipe: Recipe,
    tokenizer: PreTrainedTokenizerBase,
    *,
    log: Callable[[str], None] | None = None,
) -> PreparedData:
    """Prepared train and eval rows for ``recipe``, from the cache or freshly built.

    Safe to call from every rank of a launch at once: one process builds, the
    others wait for it and load the result.

    Args:
        recipe: The validated recipe.
        tokenizer: The model's tokenizer.
        log: Receives progress lines (building, waiting for another process, and where no
            progress bar is drawn, each dataset read and how far tokenizing has got:
            :mod:`cptune.data.progress`);
            default: this module's logger at INFO. The stats are not logged
            here: print ``result.stats.format()`` where it suits (rank 0).

    Returns:
        The prepared data.

    Raises:
        DataError: For anything in the data, or data settings, that prevents preparation.
    """
    log = log or logger.info
    sources = resolve_sources(recipe)
    fingerprint = compute_fingerprint(recipe, tokenizer, sources)

    def build(folder: Path) -> None:
        log(f"Preparing data into {Path(recipe.dataset_prepared_path) / fingerprint}")
        _build(recipe, tokenizer, sources, folder, fingerprint, log)

    path, built = build_once(recipe.dataset_prepared_path, fingerprint, build, log=log)
    return load_prepared(path, from_cache=not built)


def cached_stats(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The formatted stats of the recipe's prepared data if a finished cache exists, else None.

    Reads nothing but the data files' bytes (for the fingerprint) and ``stats.json``;
    builds nothing. For ``cptune validate``.

    Raises:
        DataError: If a dataset path cannot be resolved.
    """
    fingerprint = compute_fingerprint(recipe, tokenizer, resolve_sources(recipe))
    folder = Path(recipe.dataset_prepared_path) / fingerprint
    if not is_built(folder, fingerprint):
        return None
    stats = PrepStats.from_json((folder / _STATS_FILE).read_text())
    stats.from_cache = True
    return f"{stats.format()}\ncache: {folder}"


def load_prepared(path: str | Path, *, from_cache: bool = True) -> PreparedData:
    """Load a finished cache folder written by :func:`prepare_datasets`."""
    path = Path(path)
    stats = PrepStats.from_json((path / _STATS_FILE).read_text())
    stats.from_cache = from_cache
    train = datasets.load_from_disk(str(path / _TRAIN))
    evaluation = datasets.load_from_disk(str(path / _EVAL)) if (path / _EVAL).is_dir() else None
    return PreparedData(train=train, eval=evaluation, path=path, stats=stats)


def load_documents(path: str | Path) -> pa.Table:
    """The documents table of a finished cache folder.

    One row per formatted row of the data (rows skipped as invalid excepted), dataset by
    dataset in recipe order (``datasets`` then ``test_datasets``), in source order:
    ``dataset`` (the index of its entry in ``stats.datasets``), ``formatted_length`` (its
    tokens before the length policy) and ``status`` (``kept``, ``truncated``, ``chunked`` (cut into
    pieces), ``too long`` (dropped), ``too short`` (dropped) or ``no trained tokens`` (dropped)).
    """
    with pa.memory_map(str(Path(path) / _DOCUMENTS_FILE)) as source:
        return pa.ipc.open_file(source).read_all()


def _tokenize_all(
    recipe: Recipe,
    tokenizer: PreTrainedTokenizerBase,
    sources: Sequence[tuple[str, DatasetConfig, ResolvedSource]],
    scratch: Path,
    log: Callable[[str], None],
) -> tuple[list[pa.Table], list[pa.Table], list[DatasetStats], pa.Table]:
    """Each dataset's samples (``datasets``, then ``test_datasets``), their stats and the documents table."""
    tables: dict[str, list[pa.Table]] = {"datasets": [], "test_datasets": []}
    all_stats = []
    documents = []
    in_a_log = not draws_progress_bars()  # no bars: lines say how far reading and tokenizing have got
    for index, (key, config, source) in enumerate(sources):
        started = time.perf_counter()
        rows = load_source(
            source, config, cache_dir=scratch / "sources", num_proc=recipe.resolved_dataset_processes
        )
        if in_a_log:
            log(
                f"{source.label}: {len(rows):,} rows read in {time.perf_counter() - started:.1f} s; tokenizing"
            )
        formatter = dataset_formatter(recipe, config, tokenizer, source.label)
        # Completion rows are cut into sequence_len pieces, as Axolotl's completion type does.
        chunk = config.row_format == "completion"
        table, stats, formatted = tokenize_dataset(
            rows,
            formatter,
            label=source.label,
            key=source.key,
            required=required_columns(config),
            sequence_len=recipe.sequence_len,
            excess_length_strategy="chunk" if chunk else recipe.excess_length_strategy,
            skip_invalid_rows=recipe.skip_invalid_rows,
            scratch_dir=scratch,
            num_proc=recipe.resolved_dataset_processes,
            min_sample_len=recipe.min_sample_len,
            column_advice=missing_columns_advice(config, source.key),
            progress=RowProgress(source.label, len(rows), log=log) if in_a_log else None,
        )
        tables[key].append(table)
        all_stats.append(stats)
        dataset = pa.array(np.full(formatted.num_rows, index, dtype=np.int32))
        documents.append(formatted.add_column(0, "dataset", dataset))
    return tables["datasets"], tables["test_datasets"], all_stats, pa.concat_tables(documents)


def _deduplicate(
    recipe: Recipe,
    train: list[pa.Table],
    test: list[pa.Table],
    stats: Sequence[DatasetStats],
    log: Callable[[str], None],
) -> tuple[list[pa.Table], list[pa.Table]]:
    """``dataset_exact_deduplication``: each list without its repeated samples, as Axolotl drops them.

    Axolotl deduplicates the merged training samples before it holds out val_set_size, and the
    test_datasets samples among themselves; for ``rl`` it then also drops the evaluation pairs
    equal to a training pair (axolotl ``utils/data/sft.py``, ``rl.py``, ``shared.py``). The
    datasets' stats are updated in place (``dropped_duplicates``; what is kept no longer counts
    the drops).
    """
    train_result = drop_duplicates(train)
    test_result = drop_duplicates(test, earlier=train_result.seen if recipe.is_preference else frozenset())
    for dataset, dropped in zip(stats, train_result.dropped + test_result.dropped, strict=True):
        tokens, trained = count_tokens(dropped)
        dataset.dropped_duplicates = dropped.num_rows
        dataset.rows_out -= dropped.num_rows
        dataset.tokens -= tokens
        dataset.trained_tokens -= trained
        if dropped.num_rows:
            log(
                f"{dataset.label}: {dropped.num_rows:,} exact duplicates dropped (dataset_exact_deduplication)"
            )
    emptied = sum(t.num_rows for t in test) and not sum(t.num_rows for t in test_result.kept)
    if recipe.is_preference and emptied:
        raise DataError(
            "dataset_exact_deduplication: every evaluation pair of test_datasets equals a training pair of "
            "datasets, so no evaluation data is left (with rl, evaluation pairs that repeat training pairs are "
            "dropped, as Axolotl drops them). Evaluate on pairs that are not in the training data, or set "
            "dataset_exact_deduplication: false."
        )
    return train_result.kept, test_result.kept


def _validation_split(train: pa.Table, val_set_size: float, seed: int) -> tuple[pa.Table, pa.Table]:
    n = train.num_rows
    # 1 or more counts rows (a whole number: the recipe's _evaluation rule refuses others); less is a share.
    count = int(val_set_size) if val_set_size >= 1 else math.ceil(n * val_set_size)
    if not 0 < count < n:
        raise DataError(
            f"val_set_size: {val_set_size} asks for {count} of the {n} training samples left after "
            "preprocessing; the evaluation split needs at least 1 and the training split too. "
            "Lower val_set_size or add data."
        )
    # A seeded permutation: the same recipe always holds out the same samples.
    chosen = np.random.default_rng(seed).permutation(n)[:count]
    is_eval = np.zeros(n, dtype=bool)
    is_eval[chosen] = True
    return train.filter(pa.array(~is_eval)), train.filter(pa.array(is_eval))


def _finish_split(table: pa.Table, recipe: Recipe) -> tuple[pa.Table, SplitStats]:
    tokens, trained = count_tokens(table)
    samples = table.num_rows
    if recipe.sample_packing:
        lengths = pc.list_value_length(table.column("input_ids")).to_pylist()
        table = pack_table(table, first_fit_decreasing(lengths, recipe.sequence_len))
    split = SplitStats(
        samples=samples,
        rows=table.num_rows,
        tokens=tokens,
        trained_tokens=trained,
        packing_efficiency=packing_efficiency(tokens, table.num_rows, recipe.sequence_len),
    )
    return table, split


def _build(
    recipe: Recipe,
    tokenizer: PreTrainedTokenizerBase,
    sources: Sequence[tuple[str, DatasetConfig, ResolvedSource]],
    folder: Path,
    fingerprint: str,
    log: Callable[[str], None],
) -> None:
    started = time.perf_counter()
    scratch = folder / "scratch"
    scratch.mkdir()
    train_tables, test_tables, dataset_stats, documents = _tokenize_all(
        recipe, tokenizer, sources, scratch, log
    )
    if recipe.dataset_exact_deduplication:
        train_tables, test_tables = _deduplicate(recipe, train_tables, test_tables, dataset_stats, log)
    train = pa.concat_tables(train_tables)
    test = pa.concat_tables(test_tables) if test_tables else None
    with (
        pa.OSFile(str(folder / _DOCUMENTS_FILE), "wb") as sink,
        pa.ipc.new_file(sink, documents.schema) as writer,
    ):
        writer.write_table(documents)
    if test is None and recipe.val_set_size:
        train, test = _validation_split(train, recipe.val_set_size, recipe.seed)
    splits = {_TRAIN: train, _EVAL: test}
    split_stats: dict[str, SplitStats | None] = {_EVAL: None}
    for name, table in splits.items():
        if table is None:
            continue
        rows, split_stats[name] = _finish_split(table, recipe)
        datasets.Dataset(InMemoryTable(rows)).save_to_disk(str(folder / name))
    # The tokenized copies in scratch are no longer needed once saved.
    shutil.rmtree(scratch)
    stats = PrepStats(
        datasets=dataset_stats,
        train=split_stats[_TRAIN] or SplitStats(),
        eval=split_stats[_EVAL],
        sequence_len=recipe.sequence_len,
        sample_packing=recipe.sample_packing,
        seconds=round(time.perf_counter() - started, 3),
        fingerprint=fingerprint,
    )
    (folder / _STATS_FILE).write_text(stats.to_json())
