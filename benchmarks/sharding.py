"""Benchmark 6: per-rank memory of the model states with FSDP2 × CP against plain DDP × CP.

A full fine-tune (AdamW) of the tiny example model on 4 processes, trained through
cptune's own ``train()`` (:mod:`benchmarks.workers.state_worker`), in three layouts:
plain DDP with cp=4 (every rank holds the states whole), FSDP2 over dp_shard=2 ×
cp=2, and FSDP2 over cp=4. Each rank counts the bytes of its own weights,
gradients and optimizer state on the last step; the largest rank is reported,
next to ``cptune validate``'s estimate for the same layout. The issue's goal: with
dp_shard × cp = 4, at most 0.3× the per-rank model-state memory of plain DDP at cp=4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import EXAMPLE_MODEL, Settings, spawn_ranks
from benchmarks.synthetic import write_pretokenized

NAME = "sharding"
TITLE = "6. Sharding model states (FSDP2)"

LAYOUTS = {
    "plain DDP, cp=4": {"context_parallel_size": 4},
    "FSDP2, dp_shard=2 × cp=2": {"context_parallel_size": 2, "fsdp_version": 2, "dp_shard_size": 2},
    "FSDP2, cp=4": {"context_parallel_size": 4, "fsdp_version": 2},
}
# Smoke: the sharded path only (2 processes), to show the code runs.
SMOKE_LAYOUTS = {"FSDP2, cp=2": {"context_parallel_size": 2, "fsdp_version": 2}}
LENGTH, ROWS, STEPS, VOCAB = 256, 8, 2, 768
GOAL = 0.3


def recipe_for(work: Path, data: Path, name: str, keys: dict[str, Any]) -> dict[str, Any]:
    return {
        "base_model": str(EXAMPLE_MODEL),
        "datasets": [{"path": str(data), "type": "pretokenized"}],
        "dataset_prepared_path": str(work / "prepared"),
        "sequence_len": LENGTH,
        "micro_batch_size": 1,
        "max_steps": STEPS,
        "learning_rate": 1e-4,
        "optimizer": "adamw_torch",
        "logging_steps": 1,
        "output_dir": str(work / name),
        "overwrite_output_dir": True,
        **keys,
    }


def run(settings: Settings) -> dict[str, Any]:
    layouts = SMOKE_LAYOUTS if settings.smoke else LAYOUTS
    work = settings.scratch(NAME)
    data = write_pretokenized(work / "rows.jsonl", ROWS, LENGTH, VOCAB, seed=11)
    rows = []
    for index, (name, keys) in enumerate(layouts.items()):
        recipe = recipe_for(work, data, f"out{index}", keys)
        path = work / f"recipe{index}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        world = 2 if settings.smoke else 4
        settings.progress(NAME, f"{name}: full fine-tune, {world} processes")
        reports = spawn_ranks("benchmarks.workers.state_worker", world, work / f"run{index}", [str(path)])
        largest = {k: max(r[k] for r in reports) for k in ("weights", "gradients", "optimizer")}
        rows.append(
            {
                "name": name,
                "keys": keys,
                "measured": largest | {"total": sum(largest.values())},
                "estimate": _estimate(recipe, world),
                "parameters": reports[0]["model_parameters"],
            }
        )
    return _summarize(rows, smoke=settings.smoke) | {"processes": 2 if settings.smoke else 4}


def _estimate(recipe: dict[str, Any], world: int) -> dict[str, int]:
    """What ``cptune validate`` estimates for this layout (the same functions)."""
    from transformers import AutoConfig

    from cptune.config.loader import validate_recipe
    from cptune.models.sizing import count_parameters
    from cptune.parallel.layout import ParallelDims
    from cptune.parallel.memory import fsdp_state_memory, optimizer_state

    parsed = validate_recipe(recipe)
    dims = ParallelDims.from_recipe(parsed, world)
    counts = count_parameters(parsed, AutoConfig.from_pretrained(parsed.base_model))
    memory = fsdp_state_memory(
        total=counts.total,
        trainable=counts.trainable,
        optimizer=optimizer_state(parsed.optimizer, counts.trainable_shapes),
        dtype_bytes=counts.dtype_bytes,
        shard_ranks=dims.shard_group_size,
    )
    return {
        "weights": memory.weights,
        "gradients": memory.gradients,
        "optimizer": memory.optimizer,
        "total": memory.total,
    }


def _summarize(rows: list[dict[str, Any]], *, smoke: bool) -> dict[str, Any]:
    ddp = rows[0]["measured"]["total"]
    for row in rows:
        row["ratio_to_ddp"] = row["measured"]["total"] / ddp
    goals = []
    if not smoke:
        sharded = next(r for r in rows if r["keys"].get("dp_shard_size") == 2)
        goals.append(
            {
                "goal": f"model states per rank with FSDP2 dp_shard=2 × cp=2 <= {GOAL}x plain DDP at cp=4",
                "measured": f"{sharded['ratio_to_ddp']:.3f}x",
                "met": sharded["ratio_to_ddp"] <= GOAL,
            }
        )
    return {"rows": rows, "goals": goals, "length": LENGTH, "steps": STEPS}


def render(result: dict[str, Any], save_chart) -> str:
    def kib(value: float) -> str:
        return f"{value / 1024:.1f}"

    rows = result["rows"]
    lines = [
        f"Full fine-tune (every weight trained, AdamW, fp32) of the tiny Llama from `examples/tiny-llama` "
        f"({rows[0]['parameters']:,} parameters), rows of {result['length']} tokens, {result['steps']} optimizer "
        f"steps through cptune's `train()` on {result['processes']} processes. Each rank counts the bytes it holds itself (its "
        "local shard of a DTensor) on the last step: weights and optimizer state after the step, gradients "
        "just before it. The largest rank is shown, next to `cptune validate`'s estimate for the layout.",
        "",
        "| layout | weights (KiB) | gradients (KiB) | AdamW state (KiB) | total (KiB) | / plain DDP "
        "| estimate, total (KiB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        m = row["measured"]
        lines.append(
            f"| {row['name']} | {kib(m['weights'])} | {kib(m['gradients'])} | {kib(m['optimizer'])} | "
            f"{kib(m['total'])} | {row['ratio_to_ddp']:.3f} | {kib(row['estimate']['total'])} |"
        )
    lines += [
        "",
        "FSDP2 splits every tensor of the model states over the dp_shard × cp ranks along its first dim (a "
        "tensor whose first dim does not divide evenly is padded to equal shards; this model's all divide by "
        "4), so the states per rank shrink with the number of ranks while context parallelism splits the "
        "activations; plain DDP keeps them whole on every rank. "
        "While a layer runs, FSDP2 also holds that layer's gathered weights (not counted here; `cptune "
        "validate` prints that figure too). These byte counts do not depend on the machine: on GPUs they are "
        "the same fractions of a real model's 16 bytes per parameter.",
    ]
    return "\n".join(lines)
