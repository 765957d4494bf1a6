"""Small standalone SVG charts: grouped bars and histograms (no plotting library is needed).

Used by the benchmarks' report and by ``cptune preprocess --report``; the SVG
text embeds as it is in an HTML page or saves as a ``.svg`` file.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

PALETTE = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377")


def _nice_top(value: float) -> float:
    """A round axis maximum at or above ``value``."""
    if value <= 0:
        return 1.0
    step = 10 ** len(str(int(value))) / 10 if value >= 1 else 0.1
    for factor in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if factor * step >= value:
            return factor * step
    return 10 * step


def _frame(
    title: str,
    y_label: str,
    width: int,
    height: int,
    left: int,
    top: int,
    plot_w: float,
    plot_h: float,
    top_value: float,
) -> list[str]:
    """The opening of a chart: the svg element, background, title, y label and 5 grid lines with values."""
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">{escape(title)}</text>',
        f'<text x="12" y="{top + plot_h / 2}" transform="rotate(-90 12 {top + plot_h / 2})" '
        f'text-anchor="middle">{escape(y_label)}</text>',
    ]
    for tick in range(5):
        value = top_value * tick / 4
        y = top + plot_h - plot_h * tick / 4
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#dddddd"/>')
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{value:g}</text>')
    return parts


def bar_chart(
    title: str,
    categories: Sequence[str],
    series: dict[str, Sequence[float]],
    y_label: str,
    *,
    width: int = 640,
    height: int = 300,
) -> str:
    """SVG text of bars grouped by category, one colour per series, with a legend and a y axis."""
    left, right, top, bottom = 60, 10, 40, 60
    plot_w, plot_h = width - left - right, height - top - bottom
    top_value = _nice_top(max((v for values in series.values() for v in values), default=1.0))
    group_w = plot_w / max(1, len(categories))
    bar_w = group_w * 0.8 / max(1, len(series))
    parts = _frame(title, y_label, width, height, left, top, plot_w, plot_h, top_value)
    for g, category in enumerate(categories):
        x0 = left + g * group_w + group_w * 0.1
        for s, values in enumerate(series.values()):
            value = values[g]
            h = plot_h * value / top_value
            x = x0 + s * bar_w
            colour = PALETTE[s % len(PALETTE)]
            parts.append(
                f'<rect x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{bar_w * 0.95:.1f}" height="{h:.1f}" '
                f'fill="{colour}"><title>{escape(category)}: {value:.3g}</title></rect>'
            )
        parts.append(
            f'<text x="{x0 + group_w * 0.4:.1f}" y="{top + plot_h + 14}" text-anchor="middle">'
            f"{escape(category)}</text>"
        )
    parts.append(
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="black"/>'
    )
    for s, name in enumerate(series):
        x = left + s * (plot_w / max(1, len(series)))
        y = height - 18
        parts.append(
            f'<rect x="{x:.1f}" y="{y - 9}" width="10" height="10" fill="{PALETTE[s % len(PALETTE)]}"/>'
        )
        parts.append(f'<text x="{x + 14:.1f}" y="{y}">{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def histogram(
    title: str,
    labels: Sequence[str],
    counts: Sequence[int],
    *,
    x_label: str,
    marked: Sequence[bool] | None = None,
    marked_name: str = "",
    unmarked_name: str = "",
    width: int = 640,
    height: int = 260,
) -> str:
    """SVG text of one bar per bin, side by side, with the bin labels under the bars.

    Args:
        title: Printed above the chart.
        labels: One label per bin (e.g. ``"65-128"``).
        counts: One count per bin.
        x_label: Printed under the bin labels.
        marked: Bins drawn in the second colour (e.g. longer than ``sequence_len``).
        marked_name: Legend entry for the marked bins (none when empty).
        unmarked_name: Legend entry for the other bins (none when empty).
    """
    if len(labels) != len(counts):
        raise ValueError(f"{len(labels)} labels for {len(counts)} counts")
    marked = list(marked) if marked is not None else [False] * len(counts)
    left, right, top, bottom = 60, 10, 40, 78
    plot_w, plot_h = width - left - right, height - top - bottom
    top_value = _nice_top(max(counts, default=1))
    bar_w = plot_w / max(1, len(counts))
    parts = _frame(title, "count", width, height, left, top, plot_w, plot_h, top_value)
    for i, (label, count) in enumerate(zip(labels, counts, strict=True)):
        h = plot_h * count / top_value
        x = left + i * bar_w
        colour = PALETTE[1] if marked[i] else PALETTE[0]
        parts.append(
            f'<rect x="{x + 0.5:.1f}" y="{top + plot_h - h:.1f}" width="{max(bar_w - 1, 0.5):.1f}" '
            f'height="{h:.1f}" fill="{colour}"><title>{escape(label)}: {count}</title></rect>'
        )
        cx, cy = x + bar_w / 2, top + plot_h + 8
        parts.append(
            f'<text x="{cx:.1f}" y="{cy}" text-anchor="end" font-size="9" '
            f'transform="rotate(-45 {cx:.1f} {cy})">{escape(label)}</text>'
        )
    parts.append(
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="black"/>'
    )
    parts.append(
        f'<text x="{left + plot_w / 2}" y="{height - 22}" text-anchor="middle">{escape(x_label)}</text>'
    )
    legend = [(name, PALETTE[0]) for name in (unmarked_name,) if name]
    legend += [(name, PALETTE[1]) for name in (marked_name,) if name and any(marked)]
    for n, (name, colour) in enumerate(legend):
        x = left + n * plot_w / 2
        parts.append(f'<rect x="{x:.1f}" y="{height - 15}" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{x + 14:.1f}" y="{height - 6}">{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
