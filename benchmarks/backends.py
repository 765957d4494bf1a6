"""Benchmark 5: step time of every available CP backend at cp=2, as a ratio to cp=1 on the same data.

The backends are discovered at run time from the recipe schema: every value of
``cp_backend`` (and, for ring-flash-attn, of ``ring_attn_func``) that
:mod:`cptune.config.recipe` does not mark unavailable, in the first precision the
recipe validation accepts (fp32, else bf16). Each trains through cptune's own
``train()`` (:mod:`benchmarks.workers.train_worker`) on the same rows: unpacked,
one causal document of ``length`` tokens each, which every backend can run. cp=1
runs in each precision used, and all runs are interleaved, then repeated in
reverse order.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import EXAMPLE_MODEL, MiB, Settings, first_error_line, median, spawn_ranks
from benchmarks.synthetic import write_pretokenized

NAME = "backends"
TITLE = "5. CP backends at cp=2"

FULL = {"length": 2048, "rows": 16, "warmup": 2, "measured": 6, "rounds": 2}
SMOKE = {"length": 256, "rows": 4, "warmup": 1, "measured": 1, "rounds": 1}
PRECISIONS = {"fp32": {"bf16": False}, "bf16": {"bf16": True}}
VOCAB = 768


def literal_values(annotation: Any) -> list[Any]:
    """Every value of a ``Literal`` type, looking inside ``Optional``/unions."""
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return [v for arg in typing.get_args(annotation) for v in literal_values(arg)]


def base_recipe(work: Path, spec: dict[str, Any], data: Path) -> dict[str, Any]:
    return {
        "base_model": str(EXAMPLE_MODEL),
        "datasets": [{"path": str(data), "type": "pretokenized"}],
        "dataset_prepared_path": str(work / "prepared"),
        "sequence_len": spec["length"],
        "sample_packing": False,
        "adapter": "lora",
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_target_linear": True,
        "micro_batch_size": 1,
        "max_steps": spec["warmup"] + spec["measured"] + 1,
        "learning_rate": 0.001,
        "logging_steps": 1,
        "seed": 42,
    }


def discover(
    base: dict[str, Any], cp_size: int = 2, precisions: tuple[str, ...] = ("fp32", "bf16")
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Backend variants this cptune can run at ``cp_size`` on ``base``'s data, and those it cannot (with why).

    Each variant gets the first of ``precisions`` that the recipe validation accepts.
    """
    from cptune.config import recipe as schema
    from cptune.config.loader import validate_recipe
    from cptune.errors import RecipeError
    from cptune.parallel.backends.table import BACKENDS

    unavailable = getattr(schema, "UNAVAILABLE_CP_BACKENDS", {})
    variants, skipped = [], []
    for backend in literal_values(schema.Recipe.model_fields["cp_backend"].annotation):
        if backend in unavailable:
            skipped.append({"name": backend, "why": f"not available yet ({unavailable[backend]})"})
            continue
        variant_key = BACKENDS[backend].variant_key
        funcs: list[str | None] = [None]
        if variant_key is not None:
            funcs = literal_values(schema.Recipe.model_fields[variant_key].annotation)
        for func in funcs:
            name = backend if func is None else f"{backend} / {func}"
            keys: dict[str, Any] = {"context_parallel_size": cp_size, "cp_backend": backend}
            if func is not None:
                keys[variant_key] = func
            problem = ""
            for precision in precisions:
                try:
                    validate_recipe({**base, **keys, **PRECISIONS[precision]})
                except RecipeError as err:
                    problem = problem or str(err.problems[0] if err.problems else err)
                    continue
                variants.append({"name": name, "keys": keys, "precision": precision})
                break
            else:
                skipped.append({"name": name, "why": f"recipe refused: {problem}"})
    return variants, skipped


def run(settings: Settings) -> dict[str, Any]:
    spec = SMOKE if settings.smoke else FULL
    work = settings.scratch(NAME)
    data = write_pretokenized(work / "rows.jsonl", spec["rows"], spec["length"], VOCAB, seed=7)
    base = base_recipe(work, spec, data)
    variants, skipped = discover(base)
    if settings.smoke:  # every code path, least work: the first backend, no cp=1 reference
        variants = variants[:1]
    configs = [
        {"name": f"cp=1 ({precision})", "keys": {"context_parallel_size": 1}, "precision": precision, "cp": 1}
        for precision in PRECISIONS
        if any(v["precision"] == precision for v in variants) and not settings.smoke
    ]
    configs += [{**v, "cp": 2} for v in variants]
    settings.progress(
        NAME, f"backends: {[v['name'] for v in variants]}; skipped: {[s['name'] for s in skipped]}"
    )
    results: dict[str, dict[str, Any]] = {c["name"]: {"config": c, "runs": [], "errors": []} for c in configs}
    for round_index in range(spec["rounds"]):
        for index, config in enumerate(configs if round_index % 2 == 0 else list(reversed(configs))):
            entry = results[config["name"]]
            if entry["errors"]:
                continue
            settings.progress(NAME, f"round {round_index + 1}/{spec['rounds']}: {config['name']}")
            recipe = {
                **base,
                **config["keys"],
                **PRECISIONS[config["precision"]],
                "output_dir": str(work / f"out{index}"),
                # Every round reuses the folder: scratch, not a run to keep.
                "overwrite_output_dir": True,
            }
            path = work / f"recipe-{round_index}-{index}.yaml"
            path.write_text(yaml.safe_dump(recipe, sort_keys=False))
            try:
                reports = spawn_ranks(
                    "benchmarks.workers.train_worker",
                    config["cp"],
                    work / f"run-{round_index}-{index}",
                    ["cptune", str(path)],
                )
            except Exception as err:  # one backend failing must not stop the others
                entry["errors"].append(first_error_line(err))
                continue
            entry["runs"].append(_run_summary(reports, spec["warmup"]))
    return _summarize(spec, results, skipped)


def _run_summary(reports: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Median step time of the slowest rank, and the largest traced tensor peak over the ranks."""
    per_rank = []
    for report in reports:
        steps = report["steps"]
        timed = steps[warmup:-1] if len(steps) > warmup + 1 else steps[-1:]
        per_rank.append(median([s["seconds"] for s in timed]))
    peaks = [r["steps"][-1].get("tensor_peak") or 0 for r in reports]
    return {"step_seconds": max(per_rank), "tensor_peak": max(peaks)}


def _summarize(spec, results, skipped) -> dict[str, Any]:
    rows = []
    for name, entry in results.items():
        config = entry["config"]
        row = {"name": name, "cp": config["cp"], "precision": config["precision"], "errors": entry["errors"]}
        if entry["runs"]:
            row["step_seconds"] = median([r["step_seconds"] for r in entry["runs"]])
            row["tensor_peak"] = median([r["tensor_peak"] for r in entry["runs"]])
            row["tokens_per_second"] = spec["length"] / row["step_seconds"]
        rows.append(row)
    for row in rows:
        baseline = next((r for r in rows if r["cp"] == 1 and r["precision"] == row["precision"]), None)
        if baseline and "step_seconds" in row and "step_seconds" in baseline:
            row["step_ratio"] = row["step_seconds"] / baseline["step_seconds"]
            row["peak_ratio"] = (
                row["tensor_peak"] / baseline["tensor_peak"] if baseline["tensor_peak"] else None
            )
    return {"spec": spec, "rows": rows, "skipped": skipped}


def render(result: dict[str, Any], save_chart) -> str:
    spec = result["spec"]
    lines = [
        f"Tiny Llama from `examples/tiny-llama`, LoRA r=16, micro batch 1, unpacked rows of one causal "
        f"document of {spec['length']} tokens, trained through cptune's `train()`; median step of "
        f"{spec['measured']} after {spec['warmup']} warm-up steps (slowest rank), median over "
        f"{spec['rounds']} interleaved rounds. Ratios compare with cp=1 in the same precision.",
        "",
        "| configuration | precision | step (ms) | tokens/s | step / cp=1 | tensor peak per rank (MiB) "
        "| peak / cp=1 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if "step_seconds" not in row:
            lines.append(f"| {row['name']} | {row['precision']} | failed: {row['errors'][0]} | | | | |")
            continue
        ratio = f"{row['step_ratio']:.2f}" if "step_ratio" in row else ""
        peak_ratio = f"{row['peak_ratio']:.2f}" if row.get("peak_ratio") else ""
        lines.append(
            f"| {row['name']} | {row['precision']} | {row['step_seconds'] * 1000:.0f} | "
            f"{row['tokens_per_second']:,.0f} | {ratio} | {row['tensor_peak'] / MiB:.1f} | {peak_ratio} |"
        )
    for skip in result["skipped"]:
        lines.append(f"| {skip['name']} | | skipped: {skip['why']} | | | | |")
    lines += [
        "",
        "cp=1 runs one process on one core; cp=2 runs two processes, one core each, so 0.5 would be "
        "perfect scaling. On CPU the ring-flash-attn backends run cptune's pure-torch stand-ins for "
        "flash-attn's kernels, which are much slower, and hold much more memory, than torch's fused SDPA "
        "kernel that cp=1 and the SDPA-based backends use: these ratios show what each backend costs in "
        "a CPU dry run, not on a GPU (see the GPU script below).",
    ]
    return "\n".join(lines)
