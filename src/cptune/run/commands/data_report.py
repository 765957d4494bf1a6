"""``cptune preprocess --report``: what the prepared data looks like against the recipe.

Per dataset and in total: rows, tokens, trained tokens, document lengths
(percentiles and a histogram, before the length policy), the rows longer than
``sequence_len`` and what ``excess_length_strategy`` did to them. Per split (the
stored rows): packed rows, fill, documents per row, and how evenly the causal
attention work of a row falls on the ranks at the recipe's
``context_parallel_size`` for the contiguous and the zigzag split
(:mod:`cptune.parallel.balance`). For training: rows and target tokens per
optimizer step. Everything is computed from the cache (the stored rows, its
``stats.json`` and ``documents.arrow``); :func:`format_report` writes the text
and :mod:`cptune.run.commands.report_page` the HTML page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cptune.config.recipe import Recipe
from cptune.data.prepare import PreparedData, load_documents
from cptune.labels import IGNORE_INDEX
from cptune.parallel.backends.spec import BackendPolicy
from cptune.parallel.balance import SPLITS, causal_work_per_rank, imbalance
from cptune.parallel.layout import ParallelDims

__all__ = ["PERCENTILES", "build_report", "format_report", "length_bins", "nearest_rank", "text_histogram"]

PERCENTILES = (50, 90, 99)


def nearest_rank(sorted_values: Sequence[int] | np.ndarray, percent: float) -> int:
    """The smallest value that at least ``percent`` % of the values do not exceed (nearest rank)."""
    n = len(sorted_values)
    return int(sorted_values[max(1, math.ceil(percent / 100 * n)) - 1])


def length_bins(lengths: np.ndarray, sequence_len: int) -> list[tuple[int, int]]:
    """Inclusive ``(low, high)`` token ranges that double in size and cover ``lengths``.

    The tops are powers of two, from the first at or above the shortest length to the
    first at or above the longest; ``sequence_len`` is a top too when it falls among them,
    so every bin is either wholly within ``sequence_len`` or wholly over it.
    """
    shortest = max(1, int(lengths.min())) if len(lengths) else 1
    longest = max(1, int(lengths.max())) if len(lengths) else 1
    top = 1 << (shortest - 1).bit_length()
    tops = [top]
    while top < longest:
        top *= 2
        tops.append(top)
    if tops[0] < sequence_len < tops[-1]:
        tops = sorted({*tops, sequence_len})
    bottom = tops[0] // 2 + 1 if tops[0] > 1 else 1
    bins = []
    for top in tops:
        bins.append((bottom, top))
        bottom = top + 1
    return bins


def _lengths_summary(lengths: np.ndarray, sequence_len: int) -> dict[str, Any]:
    ordered = np.sort(lengths)
    bins = length_bins(ordered, sequence_len)
    counts = [int(((ordered >= lo) & (ordered <= hi)).sum()) for lo, hi in bins]
    summary: dict[str, Any] = {"count": len(ordered), "tokens": int(ordered.sum())}
    if len(ordered):
        summary |= {
            "min": int(ordered[0]),
            "mean": float(ordered.mean()),
            **{f"p{p}": nearest_rank(ordered, p) for p in PERCENTILES},
            "max": int(ordered[-1]),
        }
    summary["histogram"] = {"bins": [list(b) for b in bins], "counts": counts}
    return summary


def _dataset_section(
    label: str,
    rows_in: int,
    tokens: int,
    trained: int,
    lengths: np.ndarray,
    status: np.ndarray,
    recipe: Recipe,
) -> dict[str, Any]:
    over = lengths > recipe.sequence_len
    dropped = over & (status == "too long")
    truncated = over & (status == "truncated")
    chunked = over & (status == "chunked")
    return {
        "label": label,
        "rows": rows_in,
        "tokens": tokens,
        "trained_tokens": trained,
        "documents": _lengths_summary(lengths, recipe.sequence_len),
        "over_sequence_len": {
            "rows": int(over.sum()),
            "dropped": int(dropped.sum()),
            "truncated": int(truncated.sum()),
            "chunked": int(chunked.sum()),
            "tokens_lost": int(lengths[dropped].sum() + (lengths[truncated] - recipe.sequence_len).sum()),
        },
    }


def _row_arrays(dataset: Any) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Per stored row: its positions; and real tokens, trained tokens and documents per row."""
    table = dataset.data.table
    positions_col = table.column("position_ids").combine_chunks()
    labels_col = table.column("labels").combine_chunks()
    offsets = positions_col.offsets.to_numpy()
    positions = positions_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    labels = labels_col.flatten().to_numpy(zero_copy_only=False)
    lengths = np.diff(offsets)
    # A document starts wherever the position does not follow on (a stored row starts at 0, so
    # its first token counts too, whatever ended the row before it).
    starts = np.ones(len(positions), dtype=bool)
    starts[1:] = positions[1:] != positions[:-1] + 1
    trained = (labels != IGNORE_INDEX) & ~starts
    row_of = np.repeat(np.arange(len(lengths)), lengths)
    per_row_trained = np.bincount(row_of, weights=trained, minlength=len(lengths)).astype(np.int64)
    per_row_docs = np.bincount(row_of, weights=starts, minlength=len(lengths)).astype(np.int64)
    rows = [positions[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
    return rows, lengths.astype(np.int64), per_row_trained, per_row_docs


def _split_section(dataset: Any, recipe: Recipe, backend: BackendPolicy) -> tuple[dict[str, Any], np.ndarray]:
    rows, lengths, trained, docs = _row_arrays(dataset)
    n = len(rows)
    section: dict[str, Any] = {
        "rows": n,
        "documents": int(docs.sum()),
        "tokens": int(lengths.sum()),
        "trained_tokens": int(trained.sum()),
        "fill": float(lengths.sum() / (n * recipe.sequence_len)) if n else 0.0,
        "documents_per_row": {
            "min": int(docs.min()) if n else 0,
            "mean": float(docs.mean()) if n else 0.0,
            "max": int(docs.max()) if n else 0,
            "histogram": {
                str(k): int(v) for k, v in sorted(zip(*np.unique(docs, return_counts=True), strict=False))
            },
        },
        "row_tokens": _lengths_summary(lengths, recipe.sequence_len),
    }
    cp = recipe.context_parallel_size
    if cp > 1:
        attention: dict[str, Any] = {"cp": cp, "used": backend.sequence_split(recipe)}
        for split in SPLITS:
            work = [causal_work_per_rank(positions, cp, split) for positions in rows]
            ratios = [imbalance(w) for w in work]
            worst = int(np.argmax(ratios)) if ratios else 0
            attention[split] = {
                # A step waits for its slowest rank: over the epoch, the sum of the maxima against
                # the sum of the means is how much longer attention takes than if it were balanced.
                "epoch": float(sum(max(w) for w in work) / sum(sum(w) / cp for w in work)) if work else 1.0,
                "mean_row": float(np.mean(ratios)) if ratios else 1.0,
                "worst_row": float(ratios[worst]) if ratios else 1.0,
                "worst_row_index": worst,
                "worst_row_shares": [v / (sum(work[worst]) / cp) for v in work[worst]] if work else [],
            }
        section["attention"] = attention
    return section, trained


def _steps_section(recipe: Recipe, trained_per_row: np.ndarray) -> dict[str, Any]:
    dims = ParallelDims.from_recipe(recipe, recipe.default_process_count)
    per_batch = recipe.micro_batch_size * dims.dp_size
    rows_per_step = per_batch * recipe.gradient_accumulation_steps
    batches = math.ceil(len(trained_per_row) / per_batch)
    steps_per_epoch = max(1, math.ceil(batches / recipe.gradient_accumulation_steps))
    ordered = np.sort(trained_per_row)
    take = min(rows_per_step, len(ordered))
    return {
        "processes": dims.world_size,
        "data_parallel": dims.dp_size,
        "micro_batch_size": recipe.micro_batch_size,
        "gradient_accumulation_steps": recipe.gradient_accumulation_steps,
        "rows_per_step": rows_per_step,
        "steps_per_epoch": steps_per_epoch,
        "steps": recipe.max_steps or math.ceil(recipe.num_epochs * steps_per_epoch),
        "target_tokens_per_step": {
            "mean": float(ordered.sum() / steps_per_epoch),
            "lightest": int(ordered[:take].sum()),
            "heaviest": int(ordered[len(ordered) - take :].sum()),
        },
    }


def build_report(recipe: Recipe, prepared: PreparedData, backend: BackendPolicy) -> dict[str, Any]:
    """Everything the report shows, as JSON-ready data (see the module docstring).

    ``backend`` is the one that runs the recipe (its split of a row over the ranks is the report's).
    """
    documents = load_documents(prepared.path)
    dataset_index = documents.column("dataset").to_numpy()
    lengths = documents.column("formatted_length").to_numpy().astype(np.int64)
    status = np.asarray(documents.column("status").to_pylist(), dtype=object)
    stats = prepared.stats
    datasets = [
        _dataset_section(
            d.label,
            d.rows_in,
            d.tokens,
            d.trained_tokens,
            lengths[dataset_index == i],
            status[dataset_index == i],
            recipe,
        )
        for i, d in enumerate(stats.datasets)
    ]
    total = _dataset_section(
        "total",
        sum(d.rows_in for d in stats.datasets),
        sum(d.tokens for d in stats.datasets),
        sum(d.trained_tokens for d in stats.datasets),
        lengths,
        status,
        recipe,
    )
    splits: dict[str, Any] = {}
    train, trained_per_row = _split_section(prepared.train, recipe, backend)
    splits["train"] = train
    if prepared.eval is not None:
        splits["eval"] = _split_section(prepared.eval, recipe, backend)[0]
    return {
        "cache": str(prepared.path),
        "recipe": {
            "sequence_len": recipe.sequence_len,
            "sample_packing": recipe.sample_packing,
            "excess_length_strategy": recipe.excess_length_strategy,
            "context_parallel_size": recipe.context_parallel_size,
            "cp_backend": recipe.cp_backend,
        },
        "datasets": datasets,
        "total": total,
        "splits": splits,
        "steps": _steps_section(recipe, trained_per_row),
        "skipped_rows": sum(d.skipped_total for d in stats.datasets),
        "dropped_without_trained_tokens": sum(d.dropped_no_trained_tokens for d in stats.datasets),
        "dropped_duplicates": sum(d.dropped_duplicates for d in stats.datasets),
    }


def _n(value: int) -> str:
    return f"{value:,}"


def _over_line(over: dict[str, Any], recipe: Recipe, documents: int) -> str:
    if not over["rows"]:
        return f"none over sequence_len {recipe.sequence_len}"
    share = f"{over['rows'] / documents:.1%}" if documents else "-"
    if over.get("chunked") == over["rows"]:
        # Completion rows: cut into sequence_len pieces, whatever excess_length_strategy says.
        return f"{_n(over['rows'])} over sequence_len {recipe.sequence_len} ({share}): cut into sequence_len pieces"
    what = (
        f"dropped (excess_length_strategy: drop), {_n(over['tokens_lost'])} tokens never trained"
        if recipe.excess_length_strategy == "drop"
        else f"truncated to {recipe.sequence_len} tokens (excess_length_strategy: truncate), "
        f"{_n(over['tokens_lost'])} tokens cut"
    )
    return f"{_n(over['rows'])} over sequence_len {recipe.sequence_len} ({share}): {what}"


def _dataset_lines(section: dict[str, Any], recipe: Recipe) -> list[str]:
    docs = section["documents"]
    lines = [
        f"  {section['label']}: {_n(section['rows'])} rows, {_n(docs['count'])} documents; kept "
        f"{_n(section['tokens'])} tokens ({_n(section['trained_tokens'])} trained)"
    ]
    if docs["count"]:
        percentiles = ", ".join(f"p{p} {_n(docs[f'p{p}'])}" for p in PERCENTILES)
        lines.append(
            f"    length: min {_n(docs['min'])}, {percentiles}, max {_n(docs['max'])}, mean {docs['mean']:.1f}"
        )
    lines.append(f"    {_over_line(section['over_sequence_len'], recipe, docs['count'])}")
    return lines


def text_histogram(
    bins: Sequence[Sequence[int]], counts: Sequence[int], sequence_len: int, width: int = 40
) -> list[str]:
    """One line per bin: its token range, a bar, the count; bins over ``sequence_len`` say so."""
    most = max(counts, default=0) or 1
    labels = [f"{lo:,}-{hi:,}" for lo, hi in bins]
    pad = max((len(label) for label in labels), default=0)
    return [
        f"    {label:>{pad}} {'#' * math.ceil(width * count / most) if count else '':<{width}} {count:,}"
        + ("  (over sequence_len)" if lo > sequence_len else "")
        for label, (lo, _), count in zip(labels, bins, counts, strict=True)
    ]


def _split_lines(name: str, section: dict[str, Any], recipe: Recipe, backend: BackendPolicy) -> list[str]:
    per_row = section["documents_per_row"]
    packed = "packed rows" if recipe.sample_packing else "rows (one document each)"
    lines = [
        "",
        f"Stored {name} rows: {_n(section['rows'])} {packed} of at most {recipe.sequence_len} tokens, "
        f"{_n(section['tokens'])} tokens ({_n(section['trained_tokens'])} trained), fill {section['fill']:.1%} "
        "of sequence_len",
        f"  documents per row: min {per_row['min']}, mean {per_row['mean']:.1f}, max {per_row['max']}",
    ]
    attention = section.get("attention")
    if attention is None:
        lines.append("  context_parallel_size 1: every row stays whole on one process (no split to balance)")
        return lines
    lines.append(
        f"  causal attention work per rank at context_parallel_size {attention['cp']} "
        "(max/mean over the ranks, 1.00 = balanced; a step waits for the slowest rank):"
    )
    used = attention["used"]
    labels = {split: f"{split}{' (this recipe)' if split == used else ''}:" for split in SPLITS}
    width = max(len(label) for label in labels.values())
    for split in SPLITS:
        figures = attention[split]
        lines.append(
            f"    {labels[split]:<{width}} all {name} rows {figures['epoch']:.2f}, mean row "
            f"{figures['mean_row']:.2f}, worst row {figures['worst_row']:.2f} (row {figures['worst_row_index']})"
        )
    if used == "heads":
        lines.append(
            f"    this recipe ({backend.label}) splits attention by heads: every rank attends over the "
            "whole row, so its work is even (1.00)"
        )
    return lines


def format_report(report: dict[str, Any], recipe: Recipe, backend: BackendPolicy) -> str:
    """The report as text for the console and ``report.txt`` (``backend``: the one :func:`build_report` was given)."""
    r = report["recipe"]
    lines = [
        f"Data report: cache {report['cache']}",
        f"sequence_len {r['sequence_len']}, sample_packing {str(r['sample_packing']).lower()}, "
        f"excess_length_strategy {r['excess_length_strategy']}, context_parallel_size "
        f"{r['context_parallel_size']}",
        "",
        "Datasets (a document is one row of the data as formatted, its length in tokens before the "
        "length policy):",
    ]
    for section in report["datasets"]:
        lines += _dataset_lines(section, recipe)
    if len(report["datasets"]) > 1:
        lines += _dataset_lines(report["total"], recipe)
    for count, what in (
        (report["skipped_rows"], "invalid rows skipped (skip_invalid_rows), not counted as documents"),
        (report["dropped_without_trained_tokens"], "documents dropped for having no trained token"),
        (report["dropped_duplicates"], "samples dropped as exact duplicates (dataset_exact_deduplication)"),
    ):
        if count:
            lines.append(f"  {_n(count)} {what}")
    histogram = report["total"]["documents"]["histogram"]
    lines += ["", "Document lengths, all datasets (tokens: documents):"]
    lines += text_histogram(histogram["bins"], histogram["counts"], recipe.sequence_len)
    for name, section in report["splits"].items():
        lines += _split_lines(name, section, recipe, backend)
    steps = report["steps"]
    target = steps["target_tokens_per_step"]
    lines += [
        "",
        f"Optimizer steps: {steps['rows_per_step']} rows per step (micro_batch_size {steps['micro_batch_size']} "
        f"× gradient_accumulation_steps {steps['gradient_accumulation_steps']} × {steps['data_parallel']} "
        f"data-parallel group{'s' * (steps['data_parallel'] != 1)}; {steps['processes']} "
        f"process{'es' * (steps['processes'] != 1)} in all), "
        f"{_n(steps['steps_per_epoch'])} steps per epoch, {_n(steps['steps'])} steps in all",
        f"  target tokens per step: mean {target['mean']:,.1f} over an epoch; the lightest possible step "
        f"{_n(target['lightest'])}, the heaviest {_n(target['heaviest'])} (training shuffles the rows)",
    ]
    return "\n".join(lines)
