"""Benchmark 4: preprocessing throughput, and how full packed rows are against simpler strategies.

Throughput runs cptune's :func:`~cptune.data.prepare.prepare_datasets` (read,
tokenize, drop, pack, save) on synthetic alpaca rows into a fresh cache each
time. Packing efficiency (real tokens / row capacity) compares, on the same
sample lengths: cptune's first-fit-decreasing packer, a greedy next-fit packer
(samples in order; a new row whenever the next does not fit), padding every sample
to ``sequence_len``, and padding micro batches of 8 samples to their longest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import yaml

from benchmarks.common import EXAMPLE_MODEL, Settings, median
from benchmarks.synthetic import LENGTH_MIXES, write_alpaca

NAME = "data"
TITLE = "4. Data: preprocessing and packing"

FULL = {"rows": 5000, "repeats": 3, "packing_samples": 50000}
SMOKE = {"rows": 300, "repeats": 1, "packing_samples": 2000}
EFFICIENCY_GOAL = 0.97
BATCH = 8


def next_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy packing in order: keep filling the current row; open a new one when a sample does not fit."""
    bins: list[list[int]] = []
    room = 0
    for index, length in enumerate(lengths):
        if not bins or length > room:
            bins.append([])
            room = capacity
        bins[-1].append(index)
        room -= length
    return bins


def padded_to_longest(lengths: Sequence[int], batch: int) -> int:
    """Token slots used when micro batches of ``batch`` consecutive samples are padded to their longest."""
    return sum(
        max(lengths[i : i + batch]) * len(lengths[i : i + batch]) for i in range(0, len(lengths), batch)
    )


def packing_table(lengths: Sequence[int], capacity: int) -> dict[str, dict[str, float]]:
    """Efficiency (real tokens / slots) and rows of each strategy on the same lengths."""
    from cptune.data.packing import first_fit_decreasing

    real = sum(lengths)
    started = time.perf_counter()
    ffd = first_fit_decreasing(lengths, capacity)
    ffd_seconds = time.perf_counter() - started
    greedy = next_fit(lengths, capacity)
    return {
        "first-fit-decreasing (cptune)": {
            "efficiency": real / (len(ffd) * capacity),
            "rows": len(ffd),
            "seconds": ffd_seconds,
        },
        "next-fit greedy": {"efficiency": real / (len(greedy) * capacity), "rows": len(greedy)},
        f"pad micro batches of {BATCH} to their longest": {
            "efficiency": real / padded_to_longest(lengths, BATCH),
            "rows": len(lengths),
        },
        "pad every sample to sequence_len": {
            "efficiency": real / (len(lengths) * capacity),
            "rows": len(lengths),
        },
    }


def preprocess_throughput(settings: Settings, spec: dict[str, Any]) -> dict[str, Any]:
    """tokens/s of ``prepare_datasets`` over fresh caches; the median of ``repeats`` runs."""
    import datasets

    from cptune.config.loader import load_recipe
    from cptune.data.prepare import prepare_datasets
    from cptune.models.loading import load_tokenizer

    datasets.disable_progress_bars()
    work = settings.scratch(NAME)
    mix = LENGTH_MIXES[0]
    # Words, not tokens: the tiny tokenizer spends about 1.3 tokens per word of this text.
    lengths = [max(4, n * 3 // 4) for n in mix.sample(spec["rows"], seed=5)]
    data = write_alpaca(work / "alpaca.jsonl", lengths, seed=5)
    runs = []
    for repeat in range(spec["repeats"]):
        recipe_file = work / f"recipe{repeat}.yaml"
        recipe_file.write_text(
            yaml.safe_dump(
                {
                    "base_model": str(EXAMPLE_MODEL),
                    "datasets": [{"path": str(data), "type": "alpaca_instruct.load_no_prompt"}],
                    "dataset_prepared_path": str(work / f"prepared{repeat}"),
                    "sequence_len": mix.sequence_len,
                    "sample_packing": True,
                    "excess_length_strategy": "truncate",
                }
            )
        )
        recipe = load_recipe(recipe_file)
        tokenizer = load_tokenizer(recipe)
        started = time.perf_counter()
        prepared = prepare_datasets(recipe, tokenizer, log=lambda _: None)
        seconds = time.perf_counter() - started
        stats = prepared.stats
        settings.progress(NAME, f"prepare_datasets run {repeat + 1}/{spec['repeats']}: {seconds:.1f} s")
        runs.append(
            {
                "seconds": seconds,
                "tokens": stats.train.tokens,
                "rows_in": sum(d.rows_in for d in stats.datasets),
                "packing_efficiency": stats.train.packing_efficiency,
                "packed_rows": stats.train.rows,
            }
        )
    seconds = median([r["seconds"] for r in runs])
    return {
        "runs": runs,
        "median_seconds": seconds,
        "tokens_per_second": runs[0]["tokens"] / seconds,
        "rows_per_second": runs[0]["rows_in"] / seconds,
        "sequence_len": mix.sequence_len,
    }


def run(settings: Settings) -> dict[str, Any]:
    spec = SMOKE if settings.smoke else FULL
    settings.progress(NAME, f"packing {spec['packing_samples']} samples of each length mix")
    packing = []
    for mix in LENGTH_MIXES:
        count = spec["packing_samples"] * 4096 // mix.sequence_len  # fewer samples for longer rows
        lengths = mix.sample(count, seed=11)
        packing.append(
            {
                "mix": mix.name,
                "description": mix.description,
                "sequence_len": mix.sequence_len,
                "samples": count,
                "mean_length": sum(lengths) / count,
                "strategies": packing_table(lengths, mix.sequence_len),
            }
        )
    throughput = preprocess_throughput(settings, spec)
    goals = [
        {
            "goal": f"packing efficiency >= {EFFICIENCY_GOAL:.0%} ({entry['mix']})",
            "measured": f"{entry['strategies']['first-fit-decreasing (cptune)']['efficiency']:.2%}",
            "met": entry["strategies"]["first-fit-decreasing (cptune)"]["efficiency"] >= EFFICIENCY_GOAL,
        }
        for entry in packing
    ]
    return {"spec": spec, "packing": packing, "throughput": throughput, "goals": goals}


def render(result: dict[str, Any], save_chart) -> str:
    t = result["throughput"]
    lines = [
        f"**Preprocessing**: `prepare_datasets` (read jsonl, alpaca format, tokenize with the tiny BPE "
        f"tokenizer in one process, pack to {t['sequence_len']} tokens, save) on {t['runs'][0]['rows_in']} "
        f"rows / {t['runs'][0]['tokens']} tokens: **{t['tokens_per_second']:,.0f} tokens/s** "
        f"({t['rows_per_second']:,.0f} rows/s; median of {len(t['runs'])} runs of "
        f"{t['median_seconds']:.2f} s, fresh cache each). Packed rows: {t['runs'][0]['packed_rows']}, "
        f"{t['runs'][0]['packing_efficiency']:.2%} full.",
        "",
        "**Packing efficiency** (real tokens / token slots) on the same sample lengths:",
        "",
    ]
    names = list(result["packing"][0]["strategies"])
    lines += [
        "| length mix | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for entry in result["packing"]:
        cells = " | ".join(
            f"{entry['strategies'][n]['efficiency']:.2%} ({entry['strategies'][n]['rows']} rows)"
            for n in names
        )
        lines.append(
            f"| {entry['mix']}: {entry['samples']} samples, mean {entry['mean_length']:.0f} | {cells} |"
        )
    lines.append("")
    for entry in result["packing"]:
        ffd = entry["strategies"]["first-fit-decreasing (cptune)"]
        lines.append(
            f"- {entry['mix']}: {entry['description']}; first-fit-decreasing packed {entry['samples']} samples "
            f"in {ffd['seconds'] * 1000:.0f} ms."
        )
    lines += [
        "",
        "The length mixes are synthetic (seeded), shaped like public instruction and long-context sets; "
        "they are assumptions, not measurements of a dataset.",
    ]
    return "\n".join(lines)
