"""Benchmark 2: causal attention work per rank for the contiguous and zigzag layouts, counted and measured.

*Counted*: the number of (query, key) pairs a rank computes under causal masking,
pure arithmetic over the token indices that :mod:`cptune.parallel.shard` gives each
rank (``split_contiguous`` for ``varlen_llama3``, ``zigzag_indices`` for
``batch_zigzag``): a query at position p of its document sees p + 1 keys.
*Measured*: the CPU time each rank spends in the attention kernels when cptune's
ring-flash-attn backend runs attention forward and backward
(:mod:`benchmarks.workers.balance_worker`). Both are reported as max/mean over the
ranks: 1.0 is perfect balance, and a step waits for the slowest rank.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from benchmarks.common import Settings, spawn_ranks
from benchmarks.synthetic import LENGTH_MIXES
from cptune.parallel.balance import causal_work_per_rank, imbalance
from cptune.svg import bar_chart

NAME = "balance"
TITLE = "2. Load balance"

LAYOUTS = {"contiguous": "varlen_llama3", "zigzag": "batch_zigzag"}
FULL = {"cp_sizes": [2, 4, 8], "length": 4096, "repeats": 3}
SMOKE = {"cp_sizes": [2], "length": 256, "repeats": 1}
COUNTED_CP_SIZES = (2, 4, 8)
PACKED_ROWS = 40


def causal_pairs(length: int, cp_size: int, layout: str, documents: Sequence[int] | None = None) -> list[int]:
    """(query, key) pairs each rank computes for one causal row of packed ``documents``.

    The arithmetic is cptune's own (:mod:`cptune.parallel.balance`, which ``cptune preprocess --report``
    uses too); its token sets are checked against :mod:`cptune.parallel.shard` in the tests.
    """
    documents = list(documents or [length])
    if sum(documents) != length:
        raise ValueError(f"documents add up to {sum(documents)}, not {length}")
    position = [p for n in documents for p in range(n)]
    return causal_work_per_rank(position, cp_size, layout)


def packed_rows(sequence_len: int, lengths: Sequence[int], multiple: int) -> list[list[int]]:
    """Documents of each row cptune's packer makes from ``lengths``, padded to ``multiple`` with a pad document."""
    from cptune.data.packing import first_fit_decreasing

    rows = []
    for members in first_fit_decreasing(lengths, sequence_len):
        docs = [lengths[i] for i in members]
        pad = (-sum(docs)) % multiple
        rows.append(docs + ([pad] if pad else []))
    return rows


def counted(length: int) -> list[dict[str, Any]]:
    """Counted max/mean for one document of ``length`` tokens, and for packed rows of each length mix.

    For packed rows the figure is the mean over all rows that cptune's packer
    makes from a sample of the mix: the average slowdown of a step.
    """
    rows = []
    for layout in LAYOUTS:
        per_cp = {}
        for cp in COUNTED_CP_SIZES:
            pairs = causal_pairs(length, cp, layout)
            per_cp[str(cp)] = {"pairs": pairs, "max_over_mean": imbalance(pairs)}
        rows.append(
            {"case": f"{layout}, one document of {length} tokens", "layout": layout, "per_cp": per_cp}
        )
    multiple = 2 * max(COUNTED_CP_SIZES)
    for mix in LENGTH_MIXES:
        lengths, total = [], 0
        for n in mix.sample(4000, seed=1):  # about PACKED_ROWS rows' worth of samples
            if total >= PACKED_ROWS * mix.sequence_len:
                break
            lengths.append(n)
            total += n
        packed = packed_rows(mix.sequence_len, lengths, multiple)
        per_cp = {}
        for cp in COUNTED_CP_SIZES:
            ratios = [imbalance(causal_pairs(sum(docs), cp, "contiguous", docs)) for docs in packed]
            per_cp[str(cp)] = {"max_over_mean": sum(ratios) / len(ratios), "worst_row": max(ratios)}
        rows.append(
            {
                "case": f"contiguous, packed rows of the {mix.name} (mean over {len(packed)} rows)",
                "layout": "contiguous",
                "per_cp": per_cp,
            }
        )
    return rows


def run(settings: Settings) -> dict[str, Any]:
    spec = {
        **(SMOKE if settings.smoke else FULL),
        "layouts": LAYOUTS,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
    }
    world = max(spec["cp_sizes"])
    settings.progress(NAME, f"counting pairs; measuring kernels with {world} ranks, cp={spec['cp_sizes']}")
    count_rows = counted(spec["length"])
    reports = spawn_ranks(
        "benchmarks.workers.balance_worker", world, settings.scratch(NAME), [json.dumps(spec)]
    )
    measured: dict[str, dict[str, Any]] = {}
    for layout in LAYOUTS:
        for cp in spec["cp_sizes"]:
            runs = sorted(
                (
                    run
                    for r in reports
                    for run in r["runs"]
                    if run["cp_size"] == cp and run["layout"] == layout
                ),
                key=lambda run: run["cp_rank"],
            )
            # Interference from other processes only ever adds CPU time: take each rank's fastest repeat.
            seconds = [min(s["kernel_cpu_seconds"] for s in run["samples"]) for run in runs]
            measured.setdefault(layout, {})[str(cp)] = {
                "kernel_cpu_seconds": seconds,
                "max_over_mean": imbalance(seconds),
                "total": sum(seconds),
            }
    return {"spec": spec, "counted": count_rows, "measured": measured}


def render(result: dict[str, Any], save_chart) -> str:
    spec = result["spec"]
    header = " | ".join(f"cp={cp}" for cp in COUNTED_CP_SIZES)
    lines = [
        "Max/mean over the ranks of causal attention work (1.00 = perfectly balanced).",
        "",
        f"| counted (query, key) pairs | {header} |",
        "|---|" + "---:|" * len(COUNTED_CP_SIZES),
    ]
    for row in result["counted"]:
        cells = " | ".join(f"{row['per_cp'][str(cp)]['max_over_mean']:.3f}" for cp in COUNTED_CP_SIZES)
        lines.append(f"| {row['case']} | {cells} |")
    measured_header = " | ".join(f"cp={cp}" for cp in spec["cp_sizes"])
    lines += [
        "",
        f"| measured attention-kernel CPU time, {spec['length']} tokens | {measured_header} |",
        "|---|" + "---:|" * len(spec["cp_sizes"]),
    ]
    for layout, func in spec["layouts"].items():
        per_cp = result["measured"][layout]
        cells = " | ".join(
            f"{per_cp[str(cp)]['max_over_mean']:.2f} (total {per_cp[str(cp)]['total']:.2f} s)"
            for cp in spec["cp_sizes"]
        )
        lines.append(f"| {layout} (`{func}`) | {cells} |")
    cp = max(spec["cp_sizes"])
    counted_rows = {row["layout"]: row for row in result["counted"] if "pairs" in row["per_cp"][str(cp)]}

    def normalised(values: Sequence[float]) -> list[float]:
        mean = sum(values) / len(values)
        return [v / mean for v in values]

    chart = save_chart(
        "balance.svg",
        bar_chart(
            f"Attention work per rank at cp={cp}, one causal document (1.0 = mean)",
            [f"rank {r}" for r in range(cp)],
            {
                "contiguous, counted": normalised(counted_rows["contiguous"]["per_cp"][str(cp)]["pairs"]),
                "contiguous, measured": normalised(
                    result["measured"]["contiguous"][str(cp)]["kernel_cpu_seconds"]
                ),
                "zigzag, counted": normalised(counted_rows["zigzag"]["per_cp"][str(cp)]["pairs"]),
                "zigzag, measured": normalised(result["measured"]["zigzag"][str(cp)]["kernel_cpu_seconds"]),
            },
            "work / mean",
        ),
    )
    lines += [
        "",
        f"![attention work per rank]({chart})",
        "",
        "Contiguous slices give rank r of N about (2r+1)/N² of the causal pairs, so the last rank does "
        "(2N-1)/N times the mean; zigzag chunks (r, 2N-1-r) give every rank the same count. Packing many "
        "short documents into a row balances contiguous slices by itself, because each document's "
        "triangle is small. Measured: bf16 query/key/value (4 query heads, 2 KV heads, head dim 16), one "
        f"attention layer forward and backward, each rank's fastest of {spec['repeats']} repeats of the "
        "CPU time inside the flash-attn kernels (cptune's CPU stand-ins), timed per thread so that waiting "
        "for a core or a peer is not counted. The CPU kernels compute scores in blocks of up to millions "
        "of scores, skipping only blocks that are wholly masked, and large blocks run slower per score "
        "than small ones; so the measured balance follows the kernels' blocks more than the exact count "
        "(flash-attn's small tiles on a GPU follow the count closely). The ring's own arithmetic "
        "(merging partial outputs) is not counted.",
    ]
    return "\n".join(lines)
