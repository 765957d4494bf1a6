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
  with the functions cptune's trainer installs them with;
* ``trainer_norms``: ``trainer`` with ``recompute_norms`` (each RMSNorm keeps its bf16 input and
  recomputes in the backward), installed after the other settings ran;
* ``trainer_two_level``: ``trainer_norms`` with ``activation_offloading: two_level`` (every second
  layer's input offloaded, the others regenerated in the backward), switched on after the others ran;
* ``trainer``: everything, with the step as cptune's Trainer runs a bf16 recipe: the forward and
  the head loss under bf16 autocast (accelerate wraps the forward; the backward runs outside it)
  and cptune's patch ``lora-input-kept-under-autocast`` applied. ``today`` and ``everything``
  run without autocast (bf16 weights, fp32 adapters as peft makes them), as check B of
  2026-11-26 measured them.

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


def install_everything(model) -> tuple[Any, Any]:
    """activation_offloading + tiled_mlp + cut_cross_entropy, as cptune's trainer installs them: the
    head loss, and the offloader (its stats say how much pinned host memory the layer inputs took)."""
    from cptune.models.head_loss import HeadLoss
    from cptune.models.offload import enable_activation_offloading
    from cptune.models.tiled_mlp import enable_tiled_mlp

    offloader = enable_activation_offloading(model)
    enable_tiled_mlp(model, None)
    return HeadLoss(model), offloader


# the settings with every memory feature installed
FEATURED = ("everything", "trainer", "trainer_norms", "trainer_two_level")
NORMS = ("trainer_norms", "trainer_two_level")  # ... and recompute_norms


def setting_patches(name: str):
    """The patches cptune's Trainer applies for a bf16 LoRA recipe, applied for the ``trainer`` setting only."""
    import contextlib

    if not name.startswith("trainer"):
        return contextlib.nullcontext()
    from types import SimpleNamespace

    from cptune.patches.core import PatchSet
    from cptune.patches.peft_patches import lora_input_cast_patch

    recipe = SimpleNamespace(adapter="lora", bf16=True, fp16=False)  # what the patch's predicate reads
    return PatchSet([lora_input_cast_patch()]).applied(recipe)


def measure(
    model, optimizer, loss_fn, seq_len: int, steps: int, warmup: int, device: str, autocast: bool = False
) -> dict[str, Any]:
    import contextlib

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
                forward = (
                    torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
                )
                with forward:
                    loss_sum, _ = loss_fn(model, sharded.model_kwargs, sharded.shift_labels)
                loss = scaled_step_loss(loss_sum, count_targets(batch.shift_labels), 1)
                if device == "cuda":  # where a step that runs out of memory got to
                    torch.cuda.synchronize()
                    print(f"[features]   S={seq_len} step {index}: forward done after "
                          f"{time.perf_counter() - started:.1f} s, peak so far "
                          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)  # fmt: skip
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
        except torch.OutOfMemoryError as err:
            optimizer.zero_grad(set_to_none=True)
            # torch's message says what it tried to allocate and how much was reserved but unallocated
            # (fragmentation), which tells a peak the line missed from a fragmented cache.
            row = {"error": "out of memory", "message": " ".join(str(err).split())[:500],
                   "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                   "reserved_gib": torch.cuda.max_memory_reserved() / 2**30}  # fmt: skip
            if device == "cuda":
                torch.cuda.empty_cache()
            return row
        losses.append(float(loss.detach()))
        if index >= warmup:
            times.append(time.perf_counter() - started)
        if device == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated())
    seconds = sorted(times)[len(times) // 2]
    return {"step_seconds": seconds, "step_seconds_all": times, "tokens_per_second_per_gpu": seq_len / seconds,
            "peak_gib": peak / 2**30, "losses": losses}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.feature_speed", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--lengths", type=ints, default=[65536])
    parser.add_argument(
        "--settings",
        default="today,everything",
        help="comma-separated, in order: today, everything, trainer, trainer_norms, trainer_two_level",
    )
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting and length")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=LLAMA_31_8B.layers)
    parser.add_argument(
        "--gpu-gib", type=float, default=None,
        help="use at most this much GPU memory (torch's per-process fraction), e.g. 79.6 for an H100 on an H200",
    )  # fmt: skip
    parser.add_argument(
        "--longest", action="store_true",
        help="then fit a line through the 'everything' peaks and run one step at the longest length it allows",
    )  # fmt: skip
    parser.add_argument(
        "--until-fits", action="store_true",
        help="stop after the first length that trains (give the lengths longest first)",
    )  # fmt: skip
    parser.add_argument(
        "--above", action="store_true",
        help="--longest: then one step at the next length (longest + resolution), which should run out of memory",
    )  # fmt: skip
    parser.add_argument(
        "--resolution", type=int, default=16384, help="--longest: the length is a multiple of this"
    )
    parser.add_argument(
        "--time-anchor", default=None, metavar="LENGTH:SECONDS",
        help="--longest: a step measured before (e.g. 294912:281.2, check B on an H200); with --step-budget, "
             "caps the length so that a step growing as the square of the length from there fits the budget",
    )  # fmt: skip
    parser.add_argument(
        "--step-budget", type=float, default=None, help="--longest: seconds the long step may take"
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu-features/features.json"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny Llama, 256 tokens")
    return parser.parse_args(argv)


def host_bytes_available() -> int | None:
    """MemAvailable of /proc/meminfo (the offloaded checkpoints live in pinned host memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from benchmarks.gpu.attention_paths import build
    from cptune.models.head_loss import logits_loss

    args = parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.lengths, args.steps, args.resolution = [256, 512], 1, 256
    settings = [name.strip() for name in args.settings.split(",") if name.strip()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="cptune-features-")) / "store"
    dist.init_process_group(
        "gloo" if args.dry_run else "nccl", init_method=f"file://{store}", rank=0, world_size=1
    )
    shape = dataclasses.replace(LLAMA_31_8B, layers=args.layers)
    total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    usable = args.gpu_gib * 2**30 if args.gpu_gib else total
    if device == "cuda" and args.gpu_gib and usable < total:
        torch.cuda.set_per_process_memory_fraction(usable / total)
    results: dict[str, Any] = {
        "model": "the tiny Llama (dry run)" if args.dry_run else f"{shape.name}, {args.layers} layers",
        "gpu_bytes_total": total, "gpu_bytes_usable": usable, "host_bytes_available": host_bytes_available(),
        "rows": [],
    }  # fmt: skip

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=1))

    try:
        build_args = argparse.Namespace(base_model=None, dry_run=args.dry_run, layers=args.layers)
        model = build(build_args, device)
        model.set_attn_implementation("sdpa")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        loss_fn, offloader, norms = logits_loss, None, False
        featured = [name for name in settings if name in FEATURED]
        for name in settings:  # today first: the features' hooks stay on the model once installed
            if name in FEATURED and loss_fn is logits_loss:
                loss_fn, offloader = install_everything(model)
            if name in NORMS and not norms:  # after the settings without it: its hooks stay on the model
                from cptune.models.recomputed_norms import enable_recomputed_norms

                enable_recomputed_norms(model)
                norms = True
            if offloader is not None:  # between steps: the offloader holds nothing then
                offloader.two_level = name == "trainer_two_level"
            with setting_patches(name):
                for length in args.lengths:
                    results["rows"].append(
                        run_one(model, optimizer, loss_fn, name, length, args, device, shape, offloader)
                    )
                    save()
                    if args.until_fits and "tokens_per_second_per_gpu" in results["rows"][-1]:
                        break
        if args.longest and featured:
            name = featured[-1]
            with setting_patches(name):
                results["longest"] = longest_step(
                    model, optimizer, loss_fn, results, args, device, shape, usable, name, offloader
                )
                save()
                step = results["longest"].get("step", {})
                if args.above and "tokens_per_second_per_gpu" in step:
                    # Recorded before it starts: a step cut by the phase's time limit still says it began.
                    above = step["length"] + args.resolution
                    results["longest"]["above"] = {
                        "length": above,
                        "outcome": "started; no result (cut by the time limit)",
                    }
                    save()
                    results["longest"]["above"] = run_one(model, optimizer, loss_fn, name, above, args, device, shape, offloader, steps=1, warmup=0)  # fmt: skip
                    save()
    finally:
        dist.destroy_process_group()
    print(markdown(results))
    return 0


def run_one(
    model, optimizer, loss_fn, name, length, args, device, shape, offloader=None, steps=None, warmup=None
) -> dict[str, Any]:
    """One setting at one length, with the memory model's prediction beside it.

    With fewer layers than Llama-3.1-8B's (``--layers``), ``peak_gib_full_depth`` adds to the measured peak
    the states of the layers left out (bf16 weights, fp32 adapter with its gradient and AdamW state;
    :func:`benchmarks.gpu.predict.lora_states`): every other term of the peak is one layer's working set
    and the checkpoint rows on the device, the same at any depth. The offloaded inputs in host memory
    scale with the depth (``host_gib_full_depth``, x 32 / layers).
    """
    import torch

    from benchmarks.gpu import predict

    print(f"[features] {name} at S={length} ...", flush=True)
    began = time.perf_counter()
    if device == "cuda":
        torch.cuda.empty_cache()
    steps = args.steps if steps is None else steps
    warmup = args.warmup if warmup is None else warmup
    if offloader is not None:
        offloader.stats.peak_host_bytes = offloader.stats.host_bytes
        regenerated = offloader.stats.regenerated
    try:
        row = measure(
            model, optimizer, loss_fn, length, steps, warmup, device, autocast=name.startswith("trainer")
        )
    except Exception as err:
        row = {"error": f"{type(err).__name__}: {str(err).strip()[:300]}"}
    if "message" in row:
        print(f"[features]   {row['message']}", flush=True)
    print(
        f"[features] {name} at S={length}: {row.get('error', 'done')} after {time.perf_counter() - began:.1f} s",
        flush=True,
    )
    if "tokens_per_second_per_gpu" in row:
        row |= utilization(
            shape, length, row["tokens_per_second_per_gpu"], lora_parameters(shape, 16), recompute=True
        )
    if offloader is not None and "tokens_per_second_per_gpu" in row:
        row["host_gib"] = offloader.stats.peak_host_bytes / 2**30
        row["regenerated_inputs"] = offloader.stats.regenerated - regenerated  # two-level's, over the steps
    if "peak_gib" in row and shape.layers < LLAMA_31_8B.layers:
        left_out = predict.lora_states(LLAMA_31_8B) - predict.lora_states(shape)
        row["peak_gib_full_depth"] = row["peak_gib"] + left_out / 2**30
        if "host_gib" in row:
            row["host_gib_full_depth"] = row["host_gib"] * LLAMA_31_8B.layers / shape.layers
    guess = predict.predict(predict.SETTINGS[name], length, shape=shape)
    full = predict.predict(predict.SETTINGS[name], length) if shape.layers < LLAMA_31_8B.layers else None
    return {"setting": name, "length": length, **row, "predicted_peak_gib": guess.peak_gib,
            "predicted_phase": guess.phase, "predicted_host_gib": guess.host_gib,
            **({"predicted_peak_gib_full_depth": full.peak_gib, "predicted_host_gib_full_depth": full.host_gib} if full else {})}  # fmt: skip


def longest_step(
    model, optimizer, loss_fn, results, args, device, shape, usable, name, offloader=None
) -> dict[str, Any]:
    """Fit the setting's peaks, then one step at the longest length the line (and the host RAM and time) allow."""
    from benchmarks.gpu import longest, predict

    rows = [r for r in results["rows"] if r["setting"] == name and "error" not in r]
    # The dry run has no CUDA peaks: the memory model's stand in, so the fit and the long step still run.
    measured = "predicted_peak_gib" if device == "cpu" else "peak_gib"
    points = {r["length"]: r[measured] * 2**30 for r in rows}
    if device == "cpu":
        usable = (
            predict.predict(predict.SETTINGS["everything"], 4 * max(points), shape=shape).peak_gib * 2**30
        )
    host = results["host_bytes_available"]
    per_token_host = shape.layers * shape.hidden * (2 if device == "cuda" else 4)
    host_tokens = int(0.9 * host / per_token_host) if host else None
    budget = (usable or 0) - (predict.GPU_RESERVE if device == "cuda" else 0)
    try:
        candidate = longest.candidate_length(points, budget, args.resolution, host_tokens)
    except ValueError as err:
        return {"error": str(err), "points": points}
    length, time_limit = candidate, None
    if args.time_anchor and args.step_budget:
        anchor_length, anchor_seconds = (float(x) for x in args.time_anchor.split(":"))
        time_limit = longest.length_within_time(
            anchor_length, anchor_seconds, args.step_budget, args.resolution
        )
        length = min(candidate, time_limit)
    model_says = predict.longest(predict.SETTINGS[name], gpu_bytes=usable or predict.H100_BYTES, shape=shape)
    # Recorded before the step starts: a step cut by the phase's time limit still says it began.
    result = {"setting": name, "fitted_candidate": candidate, "time_limit_tokens": time_limit, "host_limit_tokens": host_tokens,
              "fit_points_gib": {k: v / 2**30 for k, v in points.items()}, "memory_model_longest": model_says.tokens_per_gpu,
              "memory_model_host_gib": model_says.host_gib, "usable_gib": usable / 2**30,
              "step": {"length": length, "outcome": "started; no result (cut by the time limit)"}}  # fmt: skip
    results["longest"] = result
    args.out.write_text(json.dumps(results, indent=1))
    result["step"] = run_one(
        model, optimizer, loss_fn, name, length, args, device, shape, offloader, steps=1, warmup=0
    )
    return result


def markdown(results: dict[str, Any]) -> str:
    lines = [f"cp=1, {results['model']}",
             "| setting | S | tokens/s/GPU | MFU (LoRA) | HFU | peak GiB | predicted GiB |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    rows = list(results["rows"])
    if isinstance(results.get("longest", {}).get("step"), dict):
        step = results["longest"]["step"]
        if "predicted_peak_gib" in step:
            rows.append(step | {"setting": f"{step['setting']} (longest by the fit, time and host)"})
    for row in rows:
        if "error" in row:
            lines.append(
                f"| {row['setting']} | {row['length']:,} | {row['error']} | | | | {row['predicted_peak_gib']:.1f} |"
            )
        else:
            lines.append(f"| {row['setting']} | {row['length']:,} | {row['tokens_per_second_per_gpu']:,.0f} | {row['mfu']:.1%} | "
                         f"{row['hfu']:.1%} | {row['peak_gib']:.1f} | {row['predicted_peak_gib']:.1f} |")  # fmt: skip
    if "longest" in results:
        lines.append(f"longest: {json.dumps({k: v for k, v in results['longest'].items() if k != 'step'})}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
