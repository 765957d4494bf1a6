"""tokens/s of one LoRA model at cp=1 with each attention path, side by side: torch's varlen kernels
through ring-flash-attn's code, SDPA, and flash-attn when it is installed.

Usage (one GPU; the lease script runs it)::

    python -m benchmarks.gpu.attention_paths --lengths 8192,16384,32768,65536 --out OUT/paths.json
    python -m benchmarks.gpu.attention_paths --dry-run      # CPU, tiny model: the plumbing only

One Llama-3.1-8B-shaped model (random bf16 weights built in memory, or ``--base-model DIR``) with
LoRA r=16 on every linear layer, gradient checkpointing, AdamW on the adapter, one causal document
of ``S`` tokens a step (the GPU recipe template's setting), cptune's chunked token-weighted loss.
The paths differ only in how attention runs:

* ``ring-flash-attn (torch kernels)``: cptune's ``cptune`` attention and :class:`RingFlashAttnBackend`
  (``varlen_llama3``) on a one-rank group, so ring-flash-attn's llama3 code runs with cp=1 on the
  kernels cptune gives it without flash-attn (PyTorch's FlashAttention-2, see ``kernels``);
* ``sdpa``: transformers' default (what cptune runs at cp=1);
* ``flash_attention_2``: transformers' flash-attn integration, if flash-attn imports.

Steps alternate between the paths (warm-up steps first), so a drift of the machine hits all of
them alike; each path's time is the median of its timed steps, CUDA-synchronised, and its peak
memory the largest over its steps. Ratios are against ``sdpa`` at the same length. A path that
runs out of memory at a length is recorded as such.
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

RING = "ring-flash-attn (torch kernels)"
SDPA = "sdpa"
FLASH_ATTN = "flash_attention_2"


def build(args: argparse.Namespace, device: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from benchmarks.gpu.multirank_cases import construct, llama_31_8b_shaped, tiny_llama

    torch.manual_seed(0)
    if args.base_model:
        model = AutoModelForCausalLM.from_pretrained(args.base_model, dtype=torch.bfloat16).to(device)
    else:
        model = construct(tiny_llama(97) if args.dry_run else llama_31_8b_shaped(args.layers), device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    return model


def paths(device: str, strides: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """name -> (attn_implementation, backend) for every path that can run here (one ring path per stride)."""
    import torch.distributed as dist

    from cptune.parallel.backends.attention import register_attention
    from cptune.parallel.backends.local.sharding import LocalBackend
    from cptune.parallel.backends.ring_flash_attn.sharding import RingFlashAttnBackend, load_ring_flash_attn
    from cptune.parallel.kernels import flash_attn_available

    register_attention()
    found = {}
    for stride in strides:
        ring = RingFlashAttnBackend(func="varlen_llama3", causal=True, heads_k_stride=stride, cp_size=1, cp_rank=0,
                                    group=dist.group.WORLD, pad_token_id=0, kernels=load_ring_flash_attn())  # fmt: skip
        found[RING if stride == 1 else f"{RING}, heads_k_stride={stride}"] = ("cptune", ring)
    found[SDPA] = ("sdpa", LocalBackend(causal=True))
    if flash_attn_available() and device == "cuda":
        found[FLASH_ATTN] = ("flash_attention_2", LocalBackend(causal=True))
    return found


def step(model, optimizer, backend, batch) -> None:
    from cptune.parallel.backends.base import step_context
    from cptune.parallel.loss import count_targets, scaled_step_loss, token_loss_sum

    with step_context(backend):
        sharded = backend.shard(batch)
        logits = model(**sharded.model_kwargs, use_cache=False).logits
        loss = scaled_step_loss(
            token_loss_sum(logits, sharded.shift_labels), count_targets(batch.shift_labels), 1
        )
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_length(model, optimizer, found, seq_len, args, device) -> dict[str, Any]:
    """Alternate the paths step by step at one length; median time and peak memory per path."""
    import torch

    from benchmarks.gpu.multirank_cases import make_batch

    batch = make_batch(0, seq_len, model.config.vocab_size, packed=False, device=device)
    times: dict[str, list[float]] = {name: [] for name in found}
    peaks: dict[str, int] = dict.fromkeys(found, 0)
    failed: dict[str, str] = {}
    for index in range(args.warmup + args.steps):
        for name, (implementation, backend) in found.items():
            if name in failed:
                continue
            model.set_attn_implementation(implementation)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            try:
                step(model, optimizer, backend, batch)
                if device == "cuda":
                    torch.cuda.synchronize()
            except torch.OutOfMemoryError:
                failed[name] = "out of memory"
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            except Exception as err:
                failed[name] = f"{type(err).__name__}: {str(err).strip()[:300]}"
                optimizer.zero_grad(set_to_none=True)
                continue
            if index >= args.warmup:
                times[name].append(time.perf_counter() - started)
            if device == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
    rows = {}
    # FLOPs of the model measured: Llama-3.1-8B's shape with --layers layers (meaningless in a dry run).
    shape = dataclasses.replace(LLAMA_31_8B, layers=args.layers)
    adapter = lora_parameters(shape, 16)
    for name in found:
        if name in failed:
            rows[name] = {"error": failed[name]}
            continue
        seconds = sorted(times[name])[len(times[name]) // 2]
        tokens_per_second = seq_len / seconds
        rows[name] = {
            "step_seconds": seconds,
            "step_seconds_all": times[name],
            "tokens_per_second_per_gpu": tokens_per_second,
            "peak_gib": peaks[name] / 2**30,
            **utilization(shape, seq_len, tokens_per_second, adapter, recompute=True),
        }
    base = rows.get(SDPA, {}).get("tokens_per_second_per_gpu")
    for row in rows.values():
        if base and "tokens_per_second_per_gpu" in row:
            row["ratio_to_sdpa"] = row["tokens_per_second_per_gpu"] / base
    return rows


def profile(model, optimizer, found, seq_len: int, device: str, top: int = 12) -> dict[str, Any]:
    """Per path, one warm step under torch's profiler: total device time and the ``top`` kernels by it."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from benchmarks.gpu.multirank_cases import make_batch

    batch = make_batch(0, seq_len, model.config.vocab_size, packed=False, device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    table = {}
    for name, (implementation, backend) in found.items():
        model.set_attn_implementation(implementation)
        step(model, optimizer, backend, batch)  # warm
        with torch_profile(activities=activities) as prof:
            step(model, optimizer, backend, batch)
            if device == "cuda":
                torch.cuda.synchronize()
        events = [
            e for e in prof.key_averages() if e.device_type.name == ("CUDA" if device == "cuda" else "CPU")
        ]
        key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        events.sort(key=lambda e: getattr(e, key, 0), reverse=True)
        total = sum(getattr(e, key, 0) for e in events)
        table[name] = {"total_ms": total / 1e3, "top": [
            {"kernel": e.key[:120], "ms": getattr(e, key, 0) / 1e3, "calls": e.count} for e in events[:top]]}  # fmt: skip
        print(f"[profile] {name} S={seq_len}: {total / 1e3:.1f} ms of device time", flush=True)
        for row in table[name]["top"]:
            print(f"    {row['ms']:9.2f} ms {row['calls']:6d}x  {row['kernel']}", flush=True)
    return table


def kernels_used(device: str) -> str:
    import torch

    from cptune.parallel.kernels import dispatch, flash_attn_available

    if flash_attn_available():
        return "flash-attn (installed)"
    probe = torch.zeros(1, 1, 128, device=device, dtype=torch.bfloat16)
    kernel = dispatch.implementation("_flash_attn_varlen_forward", probe)
    return f"{kernel.__module__}.{kernel.__name__}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.attention_paths", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--lengths", type=ints, default=[8192, 16384, 32768, 65536])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per path and length")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--layers", type=int, default=LLAMA_31_8B.layers, help="of the in-memory 8B-shaped model"
    )
    parser.add_argument("--base-model", help="load this local model instead of building one")
    parser.add_argument(
        "--heads-k-strides",
        type=ints,
        default=[1],
        help="one ring-flash-attn path per value (KV heads its llama3 code takes at a time)",
    )
    parser.add_argument("--profile", action="store_true",
                        help="first, one profiled step per path at the first length: the top CUDA kernels")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu-paths/paths.json"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny Llama, 2 short lengths")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    args = parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.lengths, args.steps, args.warmup = [64, 128], 1, 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="cptune-paths-")) / "store"
    dist.init_process_group(
        "gloo" if args.dry_run else "nccl", init_method=f"file://{store}", rank=0, world_size=1
    )
    try:
        model = build(args, device)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        found = paths(device, tuple(args.heads_k_strides))
        results: dict[str, Any] = {
            "kernels": kernels_used(device),
            "paths": list(found),
            "settings": vars(args) | {"out": str(args.out)},
            "lengths": {},
        }
        if args.profile:
            results["profile"] = profile(model, optimizer, found, args.lengths[0], device)
            args.out.write_text(json.dumps(results, indent=1))
        for seq_len in args.lengths:
            print(f"[paths] S={seq_len} ...", flush=True)
            results["lengths"][str(seq_len)] = measure_length(model, optimizer, found, seq_len, args, device)
            args.out.write_text(
                json.dumps(results, indent=1)
            )  # keep what was measured if a later length dies
    finally:
        dist.destroy_process_group()
    print(markdown(results))
    return 0


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| S | path | tokens/s/GPU | ratio to SDPA | MFU (LoRA) | HFU | peak GiB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for seq_len, rows in results["lengths"].items():
        for name, row in rows.items():
            if "error" in row:
                lines.append(f"| {seq_len} | {name} | {row['error']} | | | | |")
                continue
            lines.append(
                f"| {seq_len} | {name} | {row['tokens_per_second_per_gpu']:,.0f} | {row.get('ratio_to_sdpa', 0):.3f} | "
                f"{row['mfu']:.1%} | {row['hfu']:.1%} | {row['peak_gib']:.1f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
