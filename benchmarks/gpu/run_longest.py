"""The longest Llama-3.1-8B-shaped LoRA sequence one GPU trains at cp=1 with every memory feature on.

Usage (on a GPU machine; a 30-minute lease is enough: about 20 minutes of runs)::

    python -m benchmarks.gpu.random_model /tmp/llama8b            # once per machine, ~2 min
    python -m benchmarks.gpu.run_longest --base-model /tmp/llama8b \\
        --results docs/benchmarks/gpu-longest.json                 # then commit that file
    python -m benchmarks --render-only                             # the page shows it
    python -m benchmarks.gpu.run_longest --dry-run                 # on CPU: the tiny model, tiny lengths

Each run trains the GPU recipe template (``llama31_8b_lora.yaml``: LoRA r=16 on every linear
layer, bf16, gradient checkpointing) through cptune's ``train()`` in one process, timed and
measured by the step probe of :mod:`benchmarks.workers.train_worker` (CUDA peak memory).
Settings: *today* (as the template) and *everything* (plus ``activation_offloading``,
``tiled_mlp`` and ``cut_cross_entropy``). In order, with a time budget that skips what would
not finish: today and everything at ``--compare-lengths`` (48K, today's longest, and 64K,
where today's settings ran out of memory), everything at a second ``--fit-lengths`` length,
a line through the two peaks, then everything at the longest length the line allows (capped
by the host RAM the offloaded checkpoints need), and one step further to bound it. Every run
has the memory model's prediction beside it (:mod:`benchmarks.gpu.predict`, what ``cptune
validate`` prints). Results: ``--results`` (JSON) and ``OUT/longest.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import EXAMPLE_MODEL, first_error_line, machine_info, spawn_ranks
from benchmarks.gpu import config, longest
from benchmarks.gpu.flops import LLAMA_31_8B, ModelShape
from benchmarks.synthetic import write_pretokenized

GiB = float(1 << 30)
TINY = ModelShape(
    name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=256, vocab=768
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.run_longest", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--base-model", default=None, help="local folder (random_model.py writes one)")
    parser.add_argument("--compare-lengths", type=ints, default=[49152, 65536])
    parser.add_argument("--fit-lengths", type=ints, default=[65536, 131072])
    parser.add_argument("--resolution", type=int, default=16384, help="the longest length is found to this")
    parser.add_argument("--budget-minutes", type=float, default=24.0, help="stop starting runs after this")
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu-longest"))
    parser.add_argument("--results", type=Path, default=None, help="JSON to write (default OUT/longest.json)")
    parser.add_argument(
        "--dry-run", action="store_true", help="on CPU: the tiny example model, tiny lengths, a memory budget"
    )
    parser.add_argument("--cpu-budget-mib", type=float, default=50.0, help="--dry-run: 'GPU memory' per run")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.base_model = args.base_model or str(EXAMPLE_MODEL)
        if args.compare_lengths == [49152, 65536]:
            # Shaped like the GPU plan: today's settings train at the first compared length only.
            args.compare_lengths, args.fit_lengths, args.resolution = [2048, 6144], [2048, 4096], 1024
    elif args.base_model is None:
        parser.error("--base-model is required (python -m benchmarks.gpu.random_model DIR writes one)")
    args.results = args.results or args.out / "longest.json"
    return args


class Runs:
    """Launches the runs, turns their reports into rows, and keeps to the time budget."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.args, self.started = args, time.monotonic()
        self.cuda = torch.cuda.is_available() and not args.dry_run
        self.shape = TINY if args.dry_run else LLAMA_31_8B
        self.template = config.load_template()
        self.rows: list[dict[str, Any]] = []
        self.count = 0
        if self.cuda:
            self.gpu_name = torch.cuda.get_device_name(0)
            self.gpu_bytes = float(torch.cuda.get_device_properties(0).total_memory)
        else:
            self.gpu_name, self.gpu_bytes = "CPU dry run", args.cpu_budget_mib * (1 << 20)

    def seconds_left(self) -> float:
        return self.args.budget_minutes * 60 - (time.monotonic() - self.started)

    def recipe(self, probe: longest.Probe) -> Path:
        from cptune.config.loader import validate_recipe

        self.count += 1
        work = self.args.out / f"run{self.count:02d}"
        work.mkdir(parents=True, exist_ok=True)
        data = work / "rows.jsonl"
        write_pretokenized(data, probe.steps + 1, probe.seq_len, self.shape.vocab, seed=self.count)
        recipe = config.build_recipe(
            self.template,
            config.RunPlan(None, tuple(sorted(probe.keys.items())), 1, probe.seq_len),
            base_model=self.args.base_model,
            data_path=data,
            prepared_path=self.args.out / "prepared",
            output_dir=work / "out",
            steps=probe.steps,
            gradient_checkpointing=True,
        )
        if not self.cuda:
            recipe.update(bf16=False, optimizer="adamw_torch")  # CPU: fp32, as the CPU suite runs
        validate_recipe(recipe)
        path = work / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return path

    def run(self, probe: longest.Probe) -> dict[str, Any]:
        from benchmarks.gpu import predict

        path = self.recipe(probe)
        print(f"[gpu-longest] {probe.label} ({probe.purpose}): {path}", flush=True)
        row: dict[str, Any] = {"setting": probe.setting, "seq_len": probe.seq_len, "purpose": probe.purpose}
        estimate = predict.predict(probe.keys, probe.seq_len, shape=self.shape, mixed=self.cuda)
        row.update(
            predicted_peak_gib=estimate.peak_gib,
            predicted_phase=estimate.phase,
            predicted_host_gib=estimate.host_gib,
        )
        started = time.monotonic()
        try:
            reports = spawn_ranks(
                "benchmarks.workers.train_worker", 1, path.parent / "ranks", ["cptune", str(path)]
            )
        except Exception as err:  # out of memory, or anything else: recorded, the search goes on
            text = str(err)
            row["status"] = "out of memory" if config.is_oom(text) else f"failed: {first_error_line(err)}"
            row["wall_seconds"] = time.monotonic() - started
            self.rows.append(row)
            return row
        steps = reports[0]["steps"]
        timed = steps[-1]
        peak = max((s.get("cuda_peak_bytes") or 0) for s in steps) if self.cuda else None
        if not self.cuda:  # the tensor peak of the traced (last) step above the model state, plus the states
            peak = (timed.get("tensor_peak") or 0) + predict.lora_states(self.shape, mixed=False)
            if peak > self.gpu_bytes - _reserve(self.cuda):
                row["status"] = "out of memory (dry-run budget)"
        row.setdefault("status", "trained")
        row.update(
            step_seconds=timed["seconds"],
            tokens_per_second=probe.seq_len / timed["seconds"],
            peak_gib=peak / GiB if peak else None,
            wall_seconds=time.monotonic() - started,
        )
        self.rows.append(row)
        return row


def _reserve(cuda: bool) -> float:
    from benchmarks.gpu.predict import GPU_RESERVE

    return GPU_RESERVE if cuda else 0.0


def host_limit(runs: Runs) -> int | None:
    """Tokens whose offloaded checkpoints fit 90% of this machine's available RAM."""
    from cptune.run.memory_plan import available_host_memory

    available = available_host_memory()
    if available is None:
        return None
    per_token = runs.shape.layers * runs.shape.hidden * (2 if runs.cuda else 4)
    return int(0.9 * available / per_token)


def search(runs: Runs) -> dict[str, Any]:
    """Fit the peaks of the short runs, then confirm and bound the longest length."""
    args = runs.args
    fitted = [
        r for r in runs.rows if r["setting"] == "everything" and r["status"] == "trained" and r["peak_gib"]
    ]
    points = {r["seq_len"]: r["peak_gib"] * GiB for r in fitted}
    from benchmarks.gpu import predict

    predicted = predict.longest(
        predict.SETTINGS["everything"],
        gpu_bytes=runs.gpu_bytes,
        shape=runs.shape,
        mixed=runs.cuda,
        reserve=_reserve(runs.cuda),
        step=args.resolution,
    )
    result: dict[str, Any] = {"predicted": predicted.tokens_per_gpu}
    if len(points) < 2:
        result["note"] = "fewer than two runs with everything on trained: no fit"
        return result
    usable = runs.gpu_bytes - _reserve(runs.cuda)
    limit = host_limit(runs)
    candidate = longest.candidate_length(points, usable, args.resolution, limit)
    result.update(fitted=candidate, host_limit=limit)
    gpu_bound = longest.candidate_length(points, usable, args.resolution, None)
    result["limited_by"] = "host RAM" if limit is not None and gpu_bound > candidate else "GPU memory"
    times = {r["seq_len"]: r["step_seconds"] for r in fitted}
    fits = fails = None
    length: int | None = candidate
    trained = {r["seq_len"] for r in fitted}
    while length is not None:
        if length in trained:  # a short run already trained at this length
            fits = max(fits or 0, length)
            length = longest.next_length(fits, fails, args.resolution)
            continue
        projected = longest.step_seconds_at(times, length) * 1.3 + 90  # features' overhead, loading
        if projected > runs.seconds_left():
            result["stopped"] = (
                f"S={length} would take ~{projected / 60:.0f} min; {runs.seconds_left() / 60:.0f} left"
            )
            break
        row = runs.run(longest.Probe("everything", length, 1, "longest"))
        if row["status"] == "trained":
            fits = max(fits or 0, length)
            times[length] = row["step_seconds"]
        elif row["status"].startswith("out of memory"):
            fails = length if fails is None else min(fails, length)
        else:
            break
        length = longest.next_length(fits, fails, args.resolution)
        if fits is not None and length is not None and limit is not None and length > limit:
            result["note"] = f"the next length would offload more than the host RAM allows ({limit} tokens)"
            break
    result.update(fits=fits, fails=fails)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = Runs(args)
    for probe in longest.first_probes(args.compare_lengths, args.fit_lengths):
        if runs.seconds_left() < 60:
            print(f"[gpu-longest] out of time: {probe.label} not run", flush=True)
            continue
        runs.run(probe)
    found = search(runs)
    import torch

    results = {
        "script": "benchmarks/gpu/run_longest.py",
        "args": {k: str(v) for k, v in vars(args).items()},
        "dry_run": args.dry_run,
        "machine": {
            "gpu": runs.gpu_name,
            "gpu_memory_gib": runs.gpu_bytes / GiB,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            **{k: v for k, v in machine_info().items() if k in ("cpu", "memory_gib", "versions", "git")},
        },
        "runs": runs.rows,
        "longest": found,
        "minutes": (time.monotonic() - runs.started) / 60,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    table = longest.markdown(results)
    (args.out / "longest.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
