"""Find the longest sequence whose memory fits a budget, from as few measurements as possible.

Pure arithmetic on ``{sequence length: measured bytes}``: each call proposes the
next length to measure on a grid. Until a length has failed, it extrapolates from
the measurements nearest the budget (growing at most ``max_growth``-fold per
probe); once the answer is bracketed, it bisects, and it stops when the longest
fitting length is known to one grid step.
"""

from __future__ import annotations

from collections.abc import Mapping


def bracket(measured: Mapping[int, float], budget: float) -> tuple[int | None, int | None]:
    """(longest measured length that fits, shortest measured length that does not)."""
    fits = [s for s, v in measured.items() if v <= budget]
    over = [s for s, v in measured.items() if v > budget]
    return (max(fits) if fits else None), (min(over) if over else None)


def next_probe(
    measured: Mapping[int, float], budget: float, grid: int, *, max_growth: float = 2.0
) -> int | None:
    """The next length to measure, or None when the answer is known to one grid step.

    Args:
        measured: Bytes measured at each length tried so far (at least one).
        budget: Bytes allowed.
        grid: Lengths are multiples of this; the answer is resolved to it.
        max_growth: Never propose more than this multiple of the longest fitting length
            (an extrapolation from two short probes must not launch an enormous one).

    Returns:
        A multiple of ``grid`` strictly inside the current bracket, or None.
    """
    if not measured:
        raise ValueError("measure one length before asking for the next")
    lo, hi = bracket(measured, budget)
    if hi is not None and (hi <= grid or (lo is not None and hi - lo <= grid)):
        return None
    if lo is not None and hi is not None:
        # Bracketed: bisect. Memory need not be smooth in the length (kernel blocks change size in
        # steps), and bisection converges whatever its shape.
        guess = (lo + hi) // 2 // grid * grid
        return guess if lo < guess < hi else None
    low = lo + grid if lo is not None else grid
    # No failing length yet (lo is set): grow from lo by at most max_growth.
    high = hi - grid if hi is not None else max(low, int(lo * max_growth // grid) * grid)
    guess = int(_interpolate(measured, budget) // grid) * grid
    guess = min(max(guess, low), high)
    if guess < low or guess in measured:
        return None
    return guess


def _interpolate(measured: Mapping[int, float], budget: float) -> float:
    """The length where the line through the two measurements nearest the budget reaches it."""
    points = sorted(measured.items(), key=lambda item: abs(item[1] - budget))[:2]
    if len(points) == 1 or points[0][0] == points[1][0]:
        length, value = points[0]
        return length * budget / value if value > 0 else 2.0 * length
    (s1, v1), (s2, v2) = points
    slope = (v2 - v1) / (s2 - s1)
    if slope <= 0:
        return max(s1, s2) * 2.0
    return s1 + (budget - v1) / slope


def affine_fit(measured: Mapping[int, float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of bytes against length (needs two lengths)."""
    xs, ys = list(measured), list(measured.values())
    if len(set(xs)) < 2:
        raise ValueError("an affine fit needs two different lengths")
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return mean_y - slope * mean_x, slope
