"""tokens/s and peak GPU memory of the 8B-shaped LoRA model at one length: today's settings, then every memory feature.

Usage (one GPU; the lease script runs it last, in the time left)::

    python -m benchmarks.gpu.feature_speed --length 65536 --out OUT/features.json
    python -m benchmarks.gpu.feature_speed --dry-run     # CPU, the tiny Llama: the plumbing only

The model of :mod:`benchmarks.gpu.attention_paths` (Llama-3.1-8B's shape, random bf16 weights
built on the GPU, LoRA r=16 on every linear layer, gradient checkpointing, AdamW on the adapter,
one causal document a step, SDPA attention as cptune runs cp=1). Two settings, one after the
other on the same model (not alternated: the features install hooks that stay for the run):

* ``today``: the GPU recipe template as it is (full logits, cptune's token-weighted loss);
* ``everything``: plus ``activation_offloading`` (checkpointed layer inputs in pinned host
  memory), ``tiled_mlp`` and ``cut_cross_entropy`` (cptune's chunked head loss), installed
  with the functions cptune's trainer installs them with.

Each setting's time is the median of its timed steps (CUDA-synchronised), its peak the largest
``max_memory_allocated`` over its steps, beside the memory model's prediction
(:mod:`benchmarks.gpu.predict`). A setting that runs out of memory is recorded as such; the
JSON is written after each setting. The longest sequence itself (check B of issue 27) takes
minutes per step at 300K tokens and is not measured here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.flops import LLAMA_31_8B, lora_parameters, utilization


def install_everything(model) -> Any:
    """activation_offloading + tiled_mlp + cut_cross_entropy, as cptune's trainer installs them."""
    from cptune.models.head_loss import HeadLoss
    from cptune.models.offload import enable_activation_offloading
    from cptune.models.tiled_mlp import enable_tiled_mlp

    enable_activation_offloading(model)
    enable_tiled_mlp(model, None)
    return HeadLoss(model)


def measure(model, optimizer, loss_fn, seq_len: int, steps: int, warmup: int, device: str) -> dict[str, Any]:
    import torch

    from benchmarks.gpu.multirank_cases import make_batch
    from cptune.parallel.backends.base import step_context
    from cptune.parallel.backends.local.sharding import LocalBackend
    from cptune.parallel.loss import count_targets, scaled_step_loss

    backend = LocalBackend(causal=True)
    batch = make_batch(0, seq_len, model.config.vocab_size, packed=False, device=device)
    times, peak, losses = [], 0, []
    for index in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            with step_context(backend):
                sharded = backend.shard(batch)
                loss_sum, _ = loss_fn(model, sharded.model_kwargs, sharded.shift_labels)
                loss = scaled_step_loss(loss_sum, count_targets(batch.shift_labels), 1)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.empty_cache()
            return {"error": "out of memory", "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        losses.append(float(loss.detach()))
        if index >= warmup:
            times.append(time.perf_counter() - started)
        if device == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated())
    seconds = sorted(times)[len(times) // 2]
    return {"step_seconds": seconds, "step_seconds_all": times, "tokens_per_second_per_gpu": seq_len / seconds,
            "peak_gib": peak / 2**30, "losses": losses}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.feature_speed", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=LLAMA_31_8B.layers)
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu-features/features.json"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny Llama, 256 tokens")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from benchmarks.gpu import predict
    from benchmarks.gpu.attention_paths import build
    from cptune.models.head_loss import logits_loss

    args = parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.length, args.steps = 256, 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="cptune-features-")) / "store"
    dist.init_process_group(
        "gloo" if args.dry_run else "nccl", init_method=f"file://{store}", rank=0, world_size=1
    )
    shape = dataclasses.replace(LLAMA_31_8B, layers=args.layers)
    results: dict[str, Any] = {
        "length": args.length,
        "settings": {},
        "model": "the tiny Llama (dry run)" if args.dry_run else f"{shape.name}, {args.layers} layers",
    }
    try:
        build_args = argparse.Namespace(base_model=None, dry_run=args.dry_run, layers=args.layers)
        model = build(build_args, device)
        model.set_attn_implementation("sdpa")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        for name, loss_fn in (("today", logits_loss), ("everything", None)):
            print(f"[features] {name} at S={args.length} ...", flush=True)
            try:
                loss_fn = loss_fn or install_everything(model)
                row = measure(model, optimizer, loss_fn, args.length, args.steps, args.warmup, device)
            except Exception as err:
                row = {"error": f"{type(err).__name__}: {str(err).strip()[:300]}"}
            if "tokens_per_second_per_gpu" in row:
                row |= utilization(shape, args.length, row["tokens_per_second_per_gpu"],
                                   lora_parameters(shape, 16), recompute=True)  # fmt: skip
            guess = predict.predict(predict.SETTINGS[name], args.length, shape=shape)
            row["predicted_peak_gib"], row["predicted_phase"] = guess.peak_gib, guess.phase
            results["settings"][name] = row
            args.out.write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    print(markdown(results))
    return 0


def markdown(results: dict[str, Any]) -> str:
    lines = [f"S = {results['length']:,} tokens, cp=1, {results['model']}",
             "| setting | tokens/s/GPU | MFU (LoRA) | HFU | peak GiB | predicted GiB |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, row in results["settings"].items():
        if "error" in row:
            lines.append(f"| {name} | {row['error']} | | | | {row['predicted_peak_gib']:.1f} |")
        else:
            lines.append(f"| {name} | {row['tokens_per_second_per_gpu']:,.0f} | {row['mfu']:.1%} | {row['hfu']:.1%} | "
                         f"{row['peak_gib']:.1f} | {row['predicted_peak_gib']:.1f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
