"""Benchmark 1: per-rank memory at cp = 1, 2, 4, and the longest sequence that fits a per-rank budget.

One launch of :mod:`benchmarks.workers.memory_worker` (4 ranks; the first C of
them compute at cp=C) measures each rank's tensor memory with torch's allocator
accounting and checks it against resident memory. The goal is the issue's:
per-rank activation memory at cp=N within 1.25x of 1/N of cp=1, so that the
longest trainable sequence grows at least 0.8·N-fold.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.budget_search import affine_fit
from benchmarks.common import MiB, Settings, spawn_ranks
from cptune.svg import bar_chart

NAME = "memory"
TITLE = "1. Memory scaling"

FULL = {
    "cp_sizes": [1, 2, 4],
    "length": 8192,
    "packed_documents": 8,
    "budget_mib": 128,
    "grid": 512,
    "first_probe_per_rank": 2048,
}
SMOKE = {
    "cp_sizes": [1, 2],
    "length": 512,
    "packed_documents": 4,
    "budget_mib": 24,
    "grid": 128,
    "first_probe_per_rank": 256,
}
ACTIVATION_GOAL = 1.25
LENGTH_GOAL = 0.8


def run(settings: Settings) -> dict[str, Any]:
    base = SMOKE if settings.smoke else FULL
    spec = {
        **base,
        "budget_bytes": int(base["budget_mib"] * MiB),
        "max_probes": 3 if settings.smoke else 6,
    }
    world = max(spec["cp_sizes"])
    settings.progress(
        NAME,
        f"{world} ranks: cp={spec['cp_sizes']} at {spec['length']} tokens, then the longest sequence "
        f"within {spec['budget_mib']} MiB per rank",
    )
    # A fixed mmap threshold: freed tensors go back to the OS, so resident memory follows live memory.
    reports = spawn_ranks(
        "benchmarks.workers.memory_worker",
        world,
        settings.scratch(NAME),
        [json.dumps(spec)],
        env={"MALLOC_MMAP_THRESHOLD_": "131072"},
    )
    return summarize(reports, spec)


def summarize(reports: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    """Per CP size: the largest per-rank values, ratios to the ideal 1/N of cp=1, and the budget search."""
    per_cp: dict[str, Any] = {}
    for cp in spec["cp_sizes"]:
        entries = [r["per_cp"][str(cp)] for r in reports if r["per_cp"][str(cp)]["active"]]
        fixed = sorted((e["fixed"] | {"cp_rank": e["cp_rank"]} for e in entries), key=lambda f: f["cp_rank"])
        keys = ("model_state", "peak", "kernel_workspace", "peak_outside_kernels", "rss_step_growth")
        largest = {k: max((f[k] or 0) for f in fixed) for k in keys}
        largest["step_cpu_seconds"] = max(f["step_cpu_seconds"] for f in fixed)
        largest["packed_peak"] = max(f["packed"]["peak"] for f in fixed)
        per_cp[str(cp)] = {"ranks": fixed, "largest": largest, "budget": entries[0]["budget"]}
    one = per_cp["1"]["largest"]
    for cp, entry in per_cp.items():
        n = int(cp)
        largest = entry["largest"]
        largest["ratio_to_ideal"] = largest["peak"] / (one["peak"] / n)
        largest["outside_ratio_to_ideal"] = largest["peak_outside_kernels"] / (
            one["peak_outside_kernels"] / n
        )
        budget = entry["budget"]
        probes = {int(k): v for k, v in budget["probes_outside_kernels"].items()}
        budget["derived_without_kernel_workspace"] = _fit_longest(
            probes, budget["budget_bytes"], budget["grid"]
        )
    longest_one = per_cp["1"]["budget"]["longest_fitting"] or 0
    for entry in per_cp.values():
        longest = entry["budget"]["longest_fitting"] or 0
        entry["budget"]["growth"] = longest / longest_one if longest_one else None
        derived = entry["budget"]["derived_without_kernel_workspace"]
        derived_one = per_cp["1"]["budget"]["derived_without_kernel_workspace"]
        entry["budget"]["derived_growth"] = derived / derived_one if derived and derived_one else None
    backend = next(r["per_cp"][str(cp)]["backend"] for r in reports for cp in spec["cp_sizes"] if cp > 1)
    return {"spec": spec, "backend": backend, "per_cp": per_cp, "goals": _goals(per_cp)}


def _fit_longest(probes: dict[int, float], budget: float, grid: int) -> int | None:
    """Longest grid length an affine fit of the probes puts within ``budget`` (a derived estimate)."""
    if len(probes) < 2:
        return None
    intercept, slope = affine_fit(probes)
    if slope <= 0:
        return None
    return int((budget - intercept) / slope // grid * grid)


def _goals(per_cp: dict[str, Any]) -> list[dict[str, Any]]:
    goals = []
    for cp, entry in per_cp.items():
        if cp == "1":
            continue
        largest, budget = entry["largest"], entry["budget"]
        goals.append(
            {
                "goal": f"activation memory per rank at cp={cp} <= {ACTIVATION_GOAL}x of 1/{cp} of cp=1",
                "measured": f"{largest['ratio_to_ideal']:.2f}x (outside attention kernels: "
                f"{largest['outside_ratio_to_ideal']:.2f}x)",
                "met": largest["ratio_to_ideal"] <= ACTIVATION_GOAL,
            }
        )
        growth = budget["growth"]
        goals.append(
            {
                "goal": f"longest sequence in the budget at cp={cp} >= {LENGTH_GOAL * int(cp):.1f}x cp=1",
                "measured": "n/a" if growth is None else f"{growth:.2f}x",
                "met": growth is not None and growth >= LENGTH_GOAL * int(cp),
            }
        )
    return goals


def render(result: dict[str, Any], save_chart) -> str:
    spec, per_cp = result["spec"], result["per_cp"]
    lines = [
        f"Tiny Llama (2 layers, hidden 64, 4 query / 2 KV heads, vocab 768), LoRA r=16 on every linear "
        f"layer, fp32, micro batch 1, one causal document of **{spec['length']} tokens**. cp=1 is cptune's "
        f"cp=1 path (transformers' `sdpa`); cp>1 is the default backend, `{result['backend']}` (on CPU, "
        "ring-flash-attn runs on cptune's pure-torch kernels). Values are the largest over the ranks of "
        "a group.",
        "",
        "| cp | tokens/rank | model state (MiB) | step peak (MiB) | x ideal 1/N | in attention kernels (MiB) "
        "| peak outside kernels (MiB) | x ideal 1/N | RSS growth (MiB) | CPU s/step | packed row: step peak "
        "(MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cp, entry in per_cp.items():
        m = entry["largest"]
        lines.append(
            f"| {cp} | {spec['length'] // int(cp)} | {m['model_state'] / MiB:.1f} | {m['peak'] / MiB:.1f} "
            f"| {m['ratio_to_ideal']:.2f} | {m['kernel_workspace'] / MiB:.1f} | "
            f"{m['peak_outside_kernels'] / MiB:.1f} | {m['outside_ratio_to_ideal']:.2f} | "
            f"{m['rss_step_growth'] / MiB:.1f} | {m['step_cpu_seconds']:.2f} | {m['packed_peak'] / MiB:.1f} |"
        )
    chart = save_chart(
        "memory.svg",
        bar_chart(
            f"Per-rank step peak at {spec['length']} tokens (largest rank)",
            [f"cp={cp}" for cp in per_cp],
            {
                "step peak": [e["largest"]["peak"] / MiB for e in per_cp.values()],
                "outside attention kernels": [
                    e["largest"]["peak_outside_kernels"] / MiB for e in per_cp.values()
                ],
                "ideal: cp=1 / N": [per_cp["1"]["largest"]["peak"] / MiB / int(cp) for cp in per_cp],
            },
            "MiB",
        ),
    )
    budget_mib = spec["budget_mib"]
    lines += [
        "",
        f"![per-rank memory]({chart})",
        "",
        f"**Longest sequence within {budget_mib} MiB per rank** (model state + step peak of the largest "
        f"rank; measured on a {spec['grid']}-token grid, bracketed between a length that fits and one "
        "that does not):",
        "",
        "| cp | longest that fits | x cp=1 | first that does not | probes | derived without kernel "
        "workspace | x cp=1 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cp, entry in per_cp.items():
        b = entry["budget"]
        growth = "n/a" if b["growth"] is None else f"{b['growth']:.2f}"
        derived_growth = "n/a" if b["derived_growth"] is None else f"{b['derived_growth']:.2f}"
        lines.append(
            f"| {cp} | {b['longest_fitting'] or 'none'} | {growth} | {b['shortest_exceeding'] or '-'} "
            f"| {len(b['probes'])} | {b['derived_without_kernel_workspace'] or 'n/a'} | {derived_growth} |"
        )
    packed_one = per_cp["1"]["largest"]["packed_peak"] / MiB
    packed_ratios = ", ".join(
        f"cp={cp}: {e['largest']['packed_peak'] / MiB / (packed_one / int(cp)):.2f}x"
        for cp, e in per_cp.items()
        if cp != "1"
    )
    lines += [
        "",
        f"*Packed row*: the same {spec['length']} tokens as {spec['packed_documents']} documents of "
        f"{spec['length'] // spec['packed_documents']} (the traced step only). At cp=1 that costs "
        f"{packed_one:.0f} MiB instead of {per_cp['1']['largest']['peak'] / MiB:.0f}: transformers' `sdpa` "
        "path turns packed `position_ids` into a full sequence x sequence mask, which grows with the "
        "square of the length, while `varlen_llama3` keeps documents apart with `cu_seqlens` alone and "
        "its CPU kernels work document by document. Against that cp=1 baseline the per-rank peak of "
        f"packed rows is well inside the goal ({packed_ratios} the ideal 1/N), but that says more about "
        "cp=1 than about CP.",
    ]
    if not all(e["budget"]["resolved"] for e in per_cp.values()):
        lines += [
            "",
            "Where the two lengths are more than one grid step apart, the search ran out of probes: at cp>1 "
            "the memory is not monotonic in the length here, because the CPU kernels' score blocks change "
            "size in steps as the length grows.",
        ]
    lines += ["", _explanation(per_cp, result["backend"]), "", *METHOD_NOTES]
    return "\n".join(lines)


def _explanation(per_cp: dict[str, Any], backend: str) -> str:
    """Why the activation goal is met or missed, from the measured split."""
    largest_cp = max(per_cp, key=int)
    m = per_cp[largest_cp]["largest"]
    outside = (
        f"Outside the attention kernels, per-rank activation memory at cp={largest_cp} is "
        f"{m['outside_ratio_to_ideal']:.2f}x the ideal 1/N: cptune's sharding splits every activation, the "
        "logits included."
    )
    if backend.endswith("varlen_llama3"):
        outside += (
            " The K/V that `varlen_llama3` all-gathers (2 x tokens x KV heads x head dim per layer, freed "
            "after each layer) is too small to set the peak for this model."
        )
    workspace = (
        f"The workspace of cptune's CPU stand-in for flash-attn's kernels ({m['kernel_workspace'] / MiB:.0f} "
        "MiB on the largest rank) computes attention in blocks of scores sized in proportion to the "
        "rank's own queries, so it shrinks with cp like the activations do."
    )
    if m["ratio_to_ideal"] <= ACTIVATION_GOAL:
        return f"**The goal is met.** {outside} {workspace}"
    return (
        f"**Why the goal is missed on CPU.** {outside} The peak is set instead by attention-kernel "
        f"workspace. {workspace} At cp=1 cptune runs torch's fused SDPA kernel, which needs almost none. "
        "On a GPU, flash-attn's workspace is a few on-chip tiles, so the outside-kernel numbers are the "
        "ones that carry over."
    )


METHOD_NOTES = [
    "How it is measured: torch's profiler with `profile_memory=True` reports every allocation and free "
    "made through torch's CPU allocator (every tensor, including kernels' scratch tensors); replaying "
    "them gives the bytes allocated above the state at the start of a step at every moment. Model state "
    "(weights, gradients, AdamW state) is counted from the tensors themselves and kept allocated between "
    "steps. *In attention kernels* is the most any one attention-kernel call held above what was "
    "allocated when it began; *outside kernels* is the peak with each kernel call counted only by its "
    "outputs. *RSS growth* is the independent check: the peak resident set of the timed step (Linux "
    "`VmHWM`, reset through `/proc/self/clear_refs` before the step) minus the resident set before it, "
    "with glibc's mmap threshold fixed so that freed tensors leave the resident set. *Derived without "
    "kernel workspace* fits a line to the probes' outside-kernel memory; it is an estimate, not a run.",
]
