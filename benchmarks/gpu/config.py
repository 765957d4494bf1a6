"""Pure parts of the GPU script: which runs to make, their recipes, and what their numbers mean."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.gpu.flops import ModelShape, lora_parameters, utilization

TEMPLATE = Path(__file__).with_name("llama31_8b_lora.yaml")
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


def load_template(path: Path = TEMPLATE) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@dataclass(frozen=True)
class RunPlan:
    """One training launch: a backend variant (None at cp=1), a CP size and a sequence length."""

    variant: str | None
    keys: tuple[tuple[str, Any], ...]
    cp_size: int
    seq_len: int

    @property
    def label(self) -> str:
        return f"{self.variant or 'cp=1'} cp={self.cp_size} S={self.seq_len}"


def plan_sweep(
    variants: list[dict[str, Any]], cp_sizes: list[int], tokens_per_gpu: list[int]
) -> list[RunPlan]:
    """Throughput runs: every variant at every cp > 1, and cp=1 once, at ``cp x tokens_per_gpu`` tokens.

    Equal tokens per GPU across cp sizes is weak scaling: ideally MFU stays constant.
    """
    plans = [RunPlan(None, (), 1, t) for t in tokens_per_gpu] if 1 in cp_sizes else []
    for variant in variants:
        keys = tuple(sorted((k, v) for k, v in variant["keys"].items() if k != "context_parallel_size"))
        plans += [
            RunPlan(variant["name"], keys, cp, cp * t) for cp in cp_sizes if cp > 1 for t in tokens_per_gpu
        ]
    return plans


def build_recipe(
    template: dict[str, Any],
    plan: RunPlan,
    *,
    base_model: str,
    data_path: Path,
    prepared_path: Path,
    output_dir: Path,
    steps: int,
    gradient_checkpointing: bool,
) -> dict[str, Any]:
    """The template with this run's settings filled in (validate with cptune before launching)."""
    recipe = copy.deepcopy(template)
    recipe.update(dict(plan.keys))
    recipe.update(
        base_model=base_model,
        dataset_prepared_path=str(prepared_path),
        sequence_len=plan.seq_len,
        max_steps=steps,
        context_parallel_size=plan.cp_size,
        output_dir=str(output_dir),
        gradient_checkpointing=gradient_checkpointing,
    )
    recipe["datasets"] = [{**recipe["datasets"][0], "path": str(data_path)}]
    return recipe


def is_oom(error_text: str) -> bool:
    return any(marker in error_text for marker in OOM_MARKERS)


def run_metrics(
    shape: ModelShape,
    plan: RunPlan,
    step_seconds: float,
    peak_bytes: int,
    peak_flops: float,
    lora_rank: int,
    recompute: bool = True,
) -> dict[str, Any]:
    """tokens/s per GPU, MFU and HFU (:mod:`benchmarks.gpu.flops`) and peak memory of one run (dp=1)."""
    tokens_per_gpu_second = plan.seq_len / step_seconds / plan.cp_size
    adapter = lora_parameters(shape, lora_rank)
    return {
        "run": plan.label,
        "variant": plan.variant or "cp=1",
        "cp_size": plan.cp_size,
        "seq_len": plan.seq_len,
        "tokens_per_gpu": plan.seq_len // plan.cp_size,
        "step_seconds": step_seconds,
        "tokens_per_second_per_gpu": tokens_per_gpu_second,
        **utilization(
            shape, plan.seq_len, tokens_per_gpu_second, adapter, recompute=recompute, peak_flops=peak_flops
        ),
        "peak_gib": peak_bytes / (1 << 30),
        "lora_parameters": adapter,
    }


def weak_scaling(rows: list[dict[str, Any]]) -> None:
    """Add each row's MFU relative to cp=1 at the same tokens per GPU (1.0 = ideal weak scaling)."""
    base = {r["tokens_per_gpu"]: r["mfu"] for r in rows if r["cp_size"] == 1}
    for row in rows:
        reference = base.get(row["tokens_per_gpu"])
        row["weak_scaling_efficiency"] = row["mfu"] / reference if reference else None


def next_length(fits: int | None, fails: int | None, resolution: int) -> int | None:
    """Max-length search on pass/fail launches: double until one fails, then bisect to ``resolution``."""
    if fits is None and fails is None:
        raise ValueError("start from a length that was tried")
    if fails is None:
        return 2 * fits
    if fits is None:
        half = fails // 2 // resolution * resolution
        return half if half >= resolution else None
    if fails - fits <= resolution:
        return None
    return (fits + fails) // 2 // resolution * resolution


def markdown_table(rows: list[dict[str, Any]], lengths: dict[str, Any]) -> str:
    """The GPU results as the markdown the results page documents."""
    lines = [
        "| run | tokens/GPU | tokens/s/GPU | MFU (LoRA model FLOPs) | HFU (with recomputation) | attention share "
        "| weak scaling | peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            status = "planned" if r["error"] == "dry run" else f"failed: {r['error'][:80]}"
            lines.append(f"| {r['run']} | | {status} | | | | | |")
            continue
        scaling = f"{r['weak_scaling_efficiency']:.2f}" if r.get("weak_scaling_efficiency") else ""
        lines.append(
            f"| {r['run']} | {r['tokens_per_gpu']} | {r['tokens_per_second_per_gpu']:,.0f} | "
            f"{r['mfu']:.1%} | {r['hfu']:.1%} | {r['attention_share']:.0%} | {scaling} | "
            f"{r['peak_gib']:.1f} |"
        )
    if lengths:
        lines += [
            "",
            "| variant | cp | longest sequence that trained | first that ran out of memory |",
            "|---|---:|---:|---:|",
        ]
        for key, found in lengths.items():
            variant, cp = key.rsplit(" cp=", 1)
            lines.append(f"| {variant} | {cp} | {found['fits'] or 'none'} | {found['fails'] or '-'} |")
    return "\n".join(lines)
