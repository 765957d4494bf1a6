"""Pure parts of the longest-sequence script (:mod:`benchmarks.gpu.run_longest`): the plan, fits, the table.

The script measures, on one GPU at cp=1, the Llama-3.1-8B LoRA recipe with today's
settings (gradient checkpointing, the chunked loss) and with every memory feature on
(activation offloading, tiled MLP, the chunked head loss). A step at 350K tokens takes
minutes, so the longest sequence is not searched by doubling: two short runs with
everything on give the peak memory as a line in the tokens (activations are linear in
the sequence with flash attention), the line gives a candidate, and one or two long runs
confirm it (it trains) and bound it (the next length runs out of memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.gpu.predict import SETTINGS


@dataclass(frozen=True)
class Probe:
    """One launch: a setting (today or everything) at a sequence length, with its steps."""

    setting: str
    seq_len: int
    steps: int
    purpose: str

    @property
    def keys(self) -> dict[str, Any]:
        return dict(SETTINGS[self.setting])

    @property
    def label(self) -> str:
        return f"{self.setting} S={self.seq_len}"


def first_probes(compare: list[int], fit: list[int]) -> list[Probe]:
    """The runs made before the search: today's settings and everything at the compared lengths, then the fit."""
    probes = [Probe("today", s, 2, "compare") for s in compare]
    probes += [Probe("everything", s, 2, "compare") for s in compare if s not in fit]
    probes += [Probe("everything", s, 2 if s == min(fit) else 1, "fit") for s in fit]
    return probes


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through ``{tokens: bytes}``."""
    if len(points) < 2:
        raise ValueError("a line needs two lengths")
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def candidate_length(points: dict[int, float], usable: float, resolution: int, host_limit: int | None) -> int:
    """The longest multiple of ``resolution`` that the fitted peak puts within ``usable`` (and the host limit)."""
    intercept, slope = fit_line(points)
    if slope <= 0:
        raise ValueError(f"the peak did not grow with the sequence: {points}")
    length = int((usable - intercept) / slope) // resolution * resolution
    if host_limit is not None:
        length = min(length, host_limit // resolution * resolution)
    return max(length, resolution)


def length_within_time(anchor_length: float, anchor_seconds: float, budget: float, resolution: int) -> int:
    """The longest multiple of ``resolution`` whose step fits ``budget`` seconds, from one measured step.

    Pessimistic above the anchor: the step's time is taken to grow as the square of the length
    (all of it attention), where the weights' share grows only linearly.
    """
    length = int(anchor_length * (budget / anchor_seconds) ** 0.5) // resolution * resolution
    return max(length, resolution)


def step_seconds_at(times: dict[int, float], length: int) -> float:
    """Projected seconds of one step at ``length`` from measured ``{length: seconds}``.

    Per token, a step costs a constant (the weights) plus a term linear in the length (causal
    attention), so a step is ``a·S + b·S²``; two measurements fix ``a`` and ``b``.
    """
    if not times:
        return 0.0
    if len(times) == 1:
        ((s, t),) = times.items()
        return t * (length / s) ** 2  # pessimistic: all attention
    (s1, t1), (s2, t2) = sorted(times.items())[-2:]
    b = (t2 / s2 - t1 / s1) / (s2 - s1)
    a = t1 / s1 - b * s1
    return max(a, 0.0) * length + max(b, 0.0) * length * length


def next_length(fits: int | None, fails: int | None, resolution: int) -> int | None:
    """After the candidate: one length up if it trained, one down if it did not; None when bracketed."""
    if fits is not None and fails is not None:
        if fails - fits <= resolution:
            return None
        return (fits + fails) // 2 // resolution * resolution
    if fits is not None:
        return fits + resolution
    if fails is not None:
        return fails - resolution if fails > resolution else None
    raise ValueError("start from a length that was tried")


def markdown(results: dict[str, Any]) -> str:
    """The script's results as the table the benchmarks page shows."""
    from cptune.parallel.memory import format_bytes

    gib = float(1 << 30)
    lines = [
        "| run | sequence (tokens) | result | tokens/s | peak (measured) | peak (predicted) | host (predicted) |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for run in results["runs"]:
        measured = format_bytes(run["peak_gib"] * gib) if run.get("peak_gib") is not None else ""
        speed = f"{run['tokens_per_second']:,.0f}" if run.get("tokens_per_second") else ""
        lines.append(
            f"| {run['setting']} | {run['seq_len']:,} | {run['status']} | {speed} | {measured} | "
            f"{format_bytes(run['predicted_peak_gib'] * gib)} ({run['predicted_phase']}) | "
            f"{format_bytes(run['predicted_host_gib'] * gib)} |"
        )
    longest = results.get("longest") or {}
    if longest:
        lines += [
            "",
            f"Longest with everything on: **{longest.get('fits') or 'none'}** tokens trained, "
            f"{longest.get('fails') or '-'} ran out of memory; the fit of the short runs gave "
            f"{longest.get('fitted') or '-'}, the memory model predicted {longest.get('predicted') or '-'} "
            f"(limited by {longest.get('limited_by', 'GPU memory')}).",
        ]
    return "\n".join(lines)
