"""GPU benchmark: tokens/s/GPU, MFU, peak memory and longest sequence per CP backend and size.

Usage (one node; not run in CI)::

    python -m benchmarks.gpu.run_gpu --base-model /models/Llama-3.1-8B --cp-sizes 1,2,4,8 \\
        --tokens-per-gpu 8192,16384 --max-length --out outputs/gpu-bench

Every run trains the Llama-3.1-8B LoRA recipe template (``llama31_8b_lora.yaml``)
through cptune's ``train()`` in ``cp`` processes (one GPU each, dp=1), on rows of
one causal document of ``cp x tokens-per-gpu`` tokens, with the step probe of
:mod:`benchmarks.workers.train_worker` (CUDA-synchronised step times, CUDA peak
memory). Backends are discovered as in the CPU suite (bf16). ``--max-length``
then searches, per backend and cp, the longest sequence that trains (doubling
until a run runs out of memory, then bisecting). ``--dry-run`` prints the plan.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from benchmarks.backends import discover
from benchmarks.common import first_error_line, median, spawn_ranks
from benchmarks.gpu import config
from benchmarks.gpu.flops import H100_BF16_DENSE_FLOPS, LLAMA_31_8B
from benchmarks.synthetic import write_pretokenized


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.run_gpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--base-model", default="meta-llama/Llama-3.1-8B", help="local folder or hub id")
    parser.add_argument("--cp-sizes", type=ints, default=[1, 2, 4, 8])
    parser.add_argument("--tokens-per-gpu", type=ints, default=[8192, 16384])
    parser.add_argument(
        "--steps", type=int, default=8, help="optimizer steps per run (the first --warmup untimed)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--max-length", action="store_true", help="also search the longest trainable sequence"
    )
    parser.add_argument("--max-length-resolution", type=int, default=8192)
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_FLOPS / 1e12)
    parser.add_argument("--vocab", type=int, default=LLAMA_31_8B.vocab, help="token ids are drawn below this")
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu-bench"))
    parser.add_argument("--dry-run", action="store_true", help="print the runs and recipes, launch nothing")
    return parser.parse_args(argv)


class Runner:
    """Launches one recipe per run and turns its rank reports into metrics."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.template = args, config.load_template()
        self.count = 0

    def recipe_for(self, plan: config.RunPlan, steps: int) -> Path:
        from cptune.config.loader import validate_recipe

        self.count += 1
        work = self.args.out / f"run{self.count:03d}"
        work.mkdir(parents=True, exist_ok=True)
        data = work / "rows.jsonl"
        if not self.args.dry_run:
            write_pretokenized(data, steps + 1, plan.seq_len, self.args.vocab, seed=self.count)
        recipe = config.build_recipe(
            self.template,
            plan,
            base_model=self.args.base_model,
            data_path=data,
            prepared_path=self.args.out / "prepared",
            output_dir=work / "out",
            steps=steps,
            gradient_checkpointing=not self.args.no_gradient_checkpointing,
        )
        validate_recipe(recipe)
        path = work / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return path

    def launch(self, plan: config.RunPlan, steps: int) -> list[dict[str, Any]] | str:
        """Rank reports, or the error line of a failed launch."""
        path = self.recipe_for(plan, steps)
        print(f"[gpu-bench] {plan.label}: {path}", flush=True)
        if self.args.dry_run:
            return "dry run"
        try:
            return spawn_ranks(
                "benchmarks.workers.train_worker", plan.cp_size, path.parent / "ranks", ["cptune", str(path)]
            )
        except Exception as err:
            text = str(err)
            return "out of memory" if config.is_oom(text) else first_error_line(err)

    def measure(self, plan: config.RunPlan) -> dict[str, Any]:
        reports = self.launch(plan, self.args.steps)
        if isinstance(reports, str):
            return {"run": plan.label, "error": reports}
        warmup = self.args.warmup
        step = max(median([s["seconds"] for s in r["steps"][warmup:]]) for r in reports)
        peak = max(s.get("cuda_peak_bytes", 0) for r in reports for s in r["steps"][warmup:])
        lora_rank = int(self.template.get("lora_r", 16))
        return config.run_metrics(
            LLAMA_31_8B,
            plan,
            step,
            peak,
            self.args.peak_tflops * 1e12,
            lora_rank,
            recompute=not self.args.no_gradient_checkpointing,
        )

    def longest(self, variant: str | None, keys: tuple, cp: int, start: int) -> dict[str, int | None]:
        fits = fails = None
        length: int | None = start
        while length is not None:
            result = self.launch(config.RunPlan(variant, keys, cp, length), steps=2)
            if isinstance(result, str) and result == "dry run":
                break
            if isinstance(result, str) and result != "out of memory":
                print(f"[gpu-bench] {variant} cp={cp} S={length} failed: {result}", flush=True)
                break
            fits, fails = (length, fails) if not isinstance(result, str) else (fits, length)
            length = config.next_length(fits, fails, self.args.max_length_resolution)
        return {"fits": fits, "fails": fails}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args)
    base = config.build_recipe(
        runner.template,
        config.RunPlan(None, (), 1, 8192),
        base_model=args.base_model,
        data_path=args.out / "rows.jsonl",
        prepared_path=args.out / "prepared",
        output_dir=args.out / "out",
        steps=args.steps,
        gradient_checkpointing=not args.no_gradient_checkpointing,
    )
    variants, skipped = discover(base, cp_size=max(2, max(args.cp_sizes)), precisions=("bf16",))
    print(f"[gpu-bench] backends: {[v['name'] for v in variants]}; skipped: {skipped}", flush=True)
    rows = [runner.measure(plan) for plan in config.plan_sweep(variants, args.cp_sizes, args.tokens_per_gpu)]
    config.weak_scaling([r for r in rows if "error" not in r])
    lengths: dict[str, Any] = {}
    if args.max_length:
        start = 2 * max(args.tokens_per_gpu)
        targets = [(None, (), 1)] if 1 in args.cp_sizes else []
        for v in variants:
            keys = tuple(sorted((k, val) for k, val in v["keys"].items() if k != "context_parallel_size"))
            targets += [(v["name"], keys, cp) for cp in args.cp_sizes if cp > 1]
        for variant, keys, cp in targets:
            lengths[f"{variant or 'cp=1'} cp={cp}"] = runner.longest(variant, keys, cp, start * cp)
    results = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "longest": lengths,
        "skipped": skipped,
    }
    (args.out / "gpu_results.json").write_text(json.dumps(results, indent=1))
    table = config.markdown_table(rows, lengths)
    (args.out / "gpu_results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
