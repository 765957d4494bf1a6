"""The data report as one standalone HTML page with SVG charts, written next to the cache.

The page holds the text report and, drawn from the same numbers
(:func:`cptune.run.commands.data_report.build_report`): a document-length histogram per
dataset (bins over ``sequence_len`` in the second colour), the documents per
stored training row, and the share of the causal attention work each rank gets
in the least balanced training row, contiguous against zigzag.
"""

from __future__ import annotations

import os
from html import escape
from pathlib import Path
from typing import Any

from cptune.atomic import write_text
from cptune.svg import bar_chart, histogram

__all__ = ["REPORT_HTML", "REPORT_TEXT", "render_page", "write_report_files"]

REPORT_HTML = "report.html"
REPORT_TEXT = "report.txt"


def _length_chart(section: dict[str, Any], sequence_len: int, strategy: str) -> str:
    bins = section["documents"]["histogram"]["bins"]
    counts = section["documents"]["histogram"]["counts"]
    over = section.get("over_sequence_len", {})
    if over.get("rows") and over.get("chunked") == over["rows"]:
        done = "cut into pieces"  # completion rows
    else:
        done = "dropped" if strategy == "drop" else "truncated"
    return histogram(
        f"Document lengths: {section['label']}",
        [f"{lo:,}-{hi:,}" for lo, hi in bins],
        counts,
        x_label="tokens per document (before the length policy)",
        marked=[lo > sequence_len for lo, _ in bins],
        unmarked_name=f"within sequence_len {sequence_len:,}",
        marked_name=f"over sequence_len ({done})",
    )


def render_page(report: dict[str, Any], text: str) -> str:
    """The HTML page: title, charts, then the text report."""
    sequence_len = report["recipe"]["sequence_len"]
    sections = report["datasets"] + ([report["total"]] if len(report["datasets"]) > 1 else [])
    strategy = report["recipe"]["excess_length_strategy"]
    charts = [_length_chart(section, sequence_len, strategy) for section in sections]
    train = report["splits"]["train"]
    per_row = train["documents_per_row"]["histogram"]
    if report["recipe"]["sample_packing"]:
        charts.append(
            histogram(
                "Documents per stored training row",
                list(per_row),
                list(per_row.values()),
                x_label="documents in a row",
            )
        )
    attention = train.get("attention")
    if attention is not None:
        cp = attention["cp"]
        charts.append(
            bar_chart(
                f"Attention work per rank at context_parallel_size {cp}, in the least balanced training row of each",
                [f"rank {r}" for r in range(cp)],
                {
                    f"contiguous (row {attention['contiguous']['worst_row_index']})": attention["contiguous"][
                        "worst_row_shares"
                    ],
                    f"zigzag (row {attention['zigzag']['worst_row_index']})": attention["zigzag"][
                        "worst_row_shares"
                    ],
                },
                "work / mean",
            )
        )
    body = "\n".join(f"<figure>{chart}</figure>" for chart in charts)
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'><title>cptune data report</title>\n"
        "<style>body{font-family:sans-serif;margin:2em;max-width:60em} figure{margin:1em 0} "
        "pre{background:#f6f6f6;padding:1em;overflow-x:auto}</style></head><body>\n"
        f"<h1>cptune data report</h1>\n<p>Cache: <code>{escape(report['cache'])}</code></p>\n"
        f"{body}\n<pre>{escape(text)}</pre>\n</body></html>\n"
    )


def write_report_files(folder: str | os.PathLike[str], report: dict[str, Any], text: str) -> Path:
    """Write ``report.txt`` and ``report.html`` into ``folder`` (each replaced whole); returns the page."""
    folder = Path(folder)
    for name, content in ((REPORT_TEXT, text + "\n"), (REPORT_HTML, render_page(report, text))):
        write_text(folder / name, content)
    return folder / REPORT_HTML
