"""``cptune preprocess``: prepare the data, then say what it holds (counts, marked rows, a report).

Preparing reuses the cache when a finished one matches the recipe and builds it
otherwise (with its progress bars), so ``--debug`` and ``--report`` always show
the rows training will read.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from cptune.config.recipe import Recipe

log = logging.getLogger("cptune.preprocess")

__all__ = ["run_preprocess", "use_colour"]


def use_colour() -> bool:
    """ANSI colour when standard output is a terminal and ``NO_COLOR`` is not set (no-color.org)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def run_preprocess(
    recipe: Recipe, *, debug_rows: int = 0, report: bool = False, as_json: bool = False
) -> str:
    """Prepare the recipe's data and return what ``cptune preprocess`` prints.

    Args:
        recipe: The validated recipe.
        debug_rows: Training rows to show with their trained tokens marked (0: none).
        report: Add the data report, and write ``report.txt`` and ``report.html`` into the cache folder.
        as_json: One JSON object (``stats``, ``debug``, ``report``) instead of text; the counts
            then go to the log (standard error).
    """
    from cptune.data.collator import PackedCollator
    from cptune.data.debug_view import debug_rows as collate_rows
    from cptune.data.debug_view import format_rows, rows_json
    from cptune.data.prepare import prepare_datasets
    from cptune.models.loading import load_tokenizer
    from cptune.parallel.backends.table import backend_for

    # The backend that runs the recipe (preprocessing starts no processes, so it needs no more of a plan).
    backend = backend_for(recipe)
    tokenizer = load_tokenizer(recipe)
    prepared = prepare_datasets(recipe, tokenizer)
    backend.runtime().check_prepared_rows(recipe, prepared)
    counts = f"{prepared.stats.format()}\ncache: {prepared.path}"
    data: dict[str, Any] = {"stats": json.loads(prepared.stats.to_json()), "cache": str(prepared.path)}
    parts = [counts]
    if debug_rows:
        total = len(prepared.train)
        shown = collate_rows(
            prepared.train,
            PackedCollator.for_recipe(recipe, tokenizer.pad_token_id),
            range(min(debug_rows, total)),
        )
        data["debug"] = rows_json(shown, tokenizer, split="train", total=total)
        parts.append(format_rows(shown, tokenizer, split="train", total=total, colour=use_colour()))
    if report:
        from cptune.run.commands.data_report import build_report, format_report
        from cptune.run.commands.report_page import write_report_files

        numbers = build_report(recipe, prepared, backend)
        text = format_report(numbers, recipe, backend)
        page = write_report_files(prepared.path, numbers, text)
        data["report"] = numbers
        data["report_page"] = str(page)
        parts += [text, f"report: {page} (and report.txt beside it)"]
    if as_json:
        log.info("%s", counts)
        return json.dumps(data, ensure_ascii=False)
    return "\n\n".join(parts)
