"""The results page's GPU section, rendered from ``docs/benchmarks/gpu_results.json``.

The CPU suite does not run the GPU scripts; their measurements are committed as JSON (one entry
per lent machine session: machine, versions, commit, command, kernels, numbers) and rendered here,
MFU and HFU recomputed from tokens/s by :mod:`benchmarks.gpu.flops`, so a change of the FLOP
count changes every figure on the page at the next ``python -m benchmarks --render-only``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from benchmarks.gpu.flops import LLAMA_31_8B, lora_parameters, utilization

GPU_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "gpu_results.json"

INTRO = """\
## GPU scripts (not run by this suite)

`benchmarks/gpu/run_gpu.py` measures what the published long-context numbers measure, on one GPU node,
for a Llama-3.1-8B LoRA recipe (`benchmarks/gpu/llama31_8b_lora.yaml`: LoRA r=16 on every linear
layer, bf16, gradient checkpointing, micro batch 1, unpacked rows of one causal document):

```bash
python -m benchmarks.gpu.run_gpu --base-model /models/Llama-3.1-8B --cp-sizes 1,2,4,8 \\
    --tokens-per-gpu 8192,16384 --max-length --out outputs/gpu-bench
python -m benchmarks.gpu.run_gpu --dry-run      # the runs and recipes, nothing launched
```

Every run goes through cptune's `train()` in `cp` processes (dp=1), timed by the same step probe as
the CPU suite, and reports per backend (discovered from the recipe schema, as in section 5) and cp size:

- **tokens/s/GPU** = sequence length / step time / cp;
- **MFU**, model FLOPs utilization, counting what a LoRA step must compute: the frozen base weights'
  forward and input gradient (`4P`), the adapter's forward and both gradients (`6·P_lora`) and
  attention (`12·L·h·S` per token, halved for causal), over the GPU's dense bf16 peak (989 TFLOP/s for
  H100/H200; `--peak-tflops`). Published MFU figures count `6P` (a full fine-tune's weight gradients
  too); for LoRA that credits the GPU with work it never does, so the page gives that figure only as
  "6P" for comparison (`benchmarks/gpu/flops.py`; for Llama-3.1-8B at 32K the 6P count reproduces
  torchtitan's ~288 TFLOP/s from 3,890 tokens/s/GPU);
- **HFU**, hardware FLOPs utilization: MFU's count plus what activation checkpointing recomputes
  (every decoder layer's forward again: `2·P_layers + 2·P_lora` and the attention forward). Both follow
  PaLM's counting (appendix B), as torchtitan and Megatron do;
- **weak-scaling efficiency** = MFU at cp=N / MFU at cp=1 with the same tokens per GPU (ideal: 1.0);
  at 8K tokens per GPU this is the end-to-end counterpart of ring-flash-attn's kernel-level
  "zigzag ≈ 90% of ideal flash-attn" (8xH800, 8K tokens/GPU);
- **peak memory** per GPU (`torch.cuda.max_memory_allocated`, largest rank);
- with `--max-length`, the **longest sequence that trains** per backend and cp (doubling until a run
  runs out of memory, then bisecting to 8K tokens), to compare with Axolotl's Llama-3.1-8B QLoRA
  129,024 tokens on 8xH100 without gradient checkpointing (`--no-gradient-checkpointing`; cptune
  loads the base weights in bf16, not 4-bit, so its weights take ~16 GB instead of ~5.5 GB per GPU).

The runs are offline: `--base-model` must be a local folder or a model already in the Hugging Face
cache (`python -m benchmarks.gpu.random_model DIR` saves a Llama-3.1-8B-shaped model with random
weights: memory and speed depend on the shapes only). Without flash-attn, ring-flash-attn runs on
PyTorch's own FlashAttention-2 (bf16/fp16 on CUDA; `cptune validate` names the kernels).

On a single lent GPU, `bash benchmarks/gpu/lease.sh` runs in one call of at most 560 s, each phase
under a hard limit (`benchmarks/gpu/LEASE.md`): the kernel checks (`benchmarks/gpu/check_kernels.py`:
forward, LSE and gradients of PyTorch's FlashAttention-2 through cptune's adapter against float64),
cp=2 and cp=4 of the real multi-rank code on the one GPU (`benchmarks/gpu/multirank.py`, ranks joined
by gloo on host copies since NCCL takes one GPU per rank), the attention paths side by side at cp=1
(`benchmarks/gpu/attention_paths.py`) and the memory features at 64K (`benchmarks/gpu/feature_speed.py`);
its results are added below with `python -m benchmarks.gpu.lease_report`. It is rehearsed on CPU in an
environment like the GPU image's (`lease.sh --dry-run`).
"""


def load_gpu_results(path: Path = GPU_RESULTS) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"runs": [], "not_measured": []}


def gpu_section(results: dict[str, Any]) -> str:
    """The whole GPU section: how to run the scripts, then every recorded session, then what is missing."""
    lines = [INTRO.rstrip(), ""]
    for run in results.get("runs", []):
        lines += _run(run)
    if results.get("not_measured"):
        lines += ["### Not measured yet", ""]
        lines += [f"- {item}" for item in results["not_measured"]]
        lines.append("")
    return "\n".join(lines)


def _run(run: dict[str, Any]) -> list[str]:
    machine = run["machine"]
    versions = ", ".join(
        f"{name} {machine[name]}"
        for name in ("torch", "transformers", "accelerate", "peft")
        if name in machine
    )
    lines = [
        f"### Measured: {run['label']}",
        "",
        f"{machine['device']} x {machine.get('gpus', 1)}, CUDA {machine['cuda']}, {versions}; flash-attn: "
        f"{machine.get('flash_attn', 'not installed')}. Code: commit {run['commit']}. {run['date']}.",
        "",
        f"`{run['command']}`" + (f" ({run['model']})" if run.get("model") else ""),
        "",
    ]
    if run.get("kernels"):
        lines += [f"Kernels behind ring-flash-attn: {run['kernels']}.", ""]
    if run.get("throughput"):
        lines += _throughput(
            run["throughput"], run.get("gradient_checkpointing", True), run.get("shape_layers")
        )
    if run.get("kernel_checks"):
        lines += _kernel_checks(run["kernel_checks"], run.get("kernel_timing"))
    if run.get("multirank"):
        lines += _multirank(run["multirank"])
    if run.get("memory_features"):
        lines += _memory_features(run["memory_features"])
    if run.get("longest"):
        lines += _memory_features(run["longest"], "The longest sequence with every memory feature on")
    if run.get("strides"):
        lines += _strides(run["strides"], run.get("shape_layers"))
    if run.get("cudnn_probe"):
        lines += _cudnn_probe(run["cudnn_probe"])
    lines += [f"- {note}" for note in run.get("notes", [])]
    return [*lines, ""]


def _throughput(rows: list[dict[str, Any]], recompute: bool, layers: int | None) -> list[str]:
    shape = LLAMA_31_8B if layers is None else dataclasses.replace(LLAMA_31_8B, layers=layers)
    adapter = lora_parameters(shape, 16)
    sdpa = {
        r["seq_len"]: r["tokens_per_second_per_gpu"] for r in rows if r["path"] == "sdpa" and "error" not in r
    }
    lines = [
        "| path | tokens | tokens/s/GPU | vs SDPA | MFU (LoRA) | HFU | MFU as 6P | peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['path']} | {r['seq_len']} | {r['error']} | | | | | |")
            continue
        speed = r["tokens_per_second_per_gpu"]
        u = utilization(shape, r["seq_len"], speed, adapter, recompute=recompute)
        ratio = f"{speed / sdpa[r['seq_len']]:.3f}" if r["seq_len"] in sdpa else ""
        lines.append(
            f"| {r['path']} | {r['seq_len']:,} | {speed:,.0f} | {ratio} | {u['mfu']:.1%} | {u['hfu']:.1%} | "
            f"{u['mfu_6p']:.1%} | {r['peak_gib']:.1f} |"
        )
    return [*lines, ""]


def _kernel_checks(checks: list[dict[str, Any]], timing: dict[str, Any] | None) -> list[str]:
    passed = sum(1 for c in checks if c["ok"])
    worst = {dtype: max(max(c.get(k, 0.0) for k in ("out", "dq", "dk", "dv")) for c in checks if c["dtype"] == dtype)
             for dtype in sorted({c["dtype"] for c in checks})}  # fmt: skip
    text = ", ".join(f"worst relative error {value:.1e} in {dtype}" for dtype, value in worst.items())
    lines = [
        f"- **Kernel checks:** {passed} of {len(checks)} passed ({text}; `benchmarks/gpu/check_kernels.py`)."
    ]
    if timing:
        if "error" in timing:
            lines.append(f"- **Kernel speed:** not measured ({timing['error']}).")
        else:
            lines.append(
                f"- **Kernel speed:** forward+backward of one {timing['tokens']:,}-token causal sequence, "
                f"{timing['adapter_ms']:.2f} ms through cptune's adapter against {timing['sdpa_flash_ms']:.2f} ms "
                f"for fused SDPA restricted to its flash backend: {timing['ratio']:.3f}x."
            )
    return lines


def _multirank(multirank: dict[str, Any]) -> list[str]:
    lines = ["", "| cp on one GPU | case | result | within limits |", "|---:|---|---|---|"]
    for cp, result in multirank["cp"].items():
        if "skipped" in result:
            lines.append(f"| {cp} | all | skipped: {result['skipped']} | |")
            continue
        if "error" in result:
            lines.append(f"| {cp} | all | {result['error']} | no |")
            continue
        for name, errors in result.get("attention", {}).items():
            worst = max(errors.values())
            lines.append(
                f"| {cp} | attention {name} | worst relative error {worst:.1e} | {result['ok'][f'attention {name}']} |"
            )
        for name, value in result.items():
            if name.startswith("model "):
                lines.append(
                    f"| {cp} | {name} | loss rel. diff {value['loss_rel']:.1e} over {len(value['cp_losses'])} steps, "
                    f"grad {value['grad_rel']:.1e} | {result['ok'][name]} |"
                )
    return [*lines, ""]


def _feature_rows(features: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a feature_speed file: a list (``rows``), or the first lease's one length by setting."""
    if "rows" in features:
        return features["rows"]
    return [
        {"setting": name, "length": features["length"], **row} for name, row in features["settings"].items()
    ]


def _memory_features(features: dict[str, Any], title: str = "Memory features") -> list[str]:
    rows = _feature_rows(features)
    step = (features.get("longest") or {}).get("step")
    if isinstance(step, dict):
        rows = [*rows, {**step, "setting": f"{step.get('setting', 'everything')}, longest by the fit"}]
    # rows of a model cut to fewer layers (feature_speed --layers) also give the peak at full depth
    depth = any("peak_gib_full_depth" in row for row in rows)
    lines = [
        f"{title}, cp=1 ({features['model']}; `benchmarks/gpu/feature_speed.py`; the prediction is "
        "`cptune validate`'s memory model"
        + (
            "; *at 32 layers* adds to the peak the states of the layers left out, and scales the pinned host "
            "memory of the offloaded layer inputs by 32 / layers"
            if depth
            else ""
        )
        + "):",
        "",
        "| setting | tokens | tokens/s/GPU | MFU (LoRA) | HFU | peak GiB | predicted GiB |"
        + (" at 32 layers: peak GiB | predicted GiB | pinned host GiB |" if depth else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if depth else ""),
    ]
    for row in rows:
        predicted = f"{row['predicted_peak_gib']:.1f}" if "predicted_peak_gib" in row else ""
        extra = ""
        if depth:
            cells = [row.get("peak_gib_full_depth"), row.get("predicted_peak_gib_full_depth")]
            cells.append(row.get("host_gib_full_depth"))
            extra = " " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |"
        if "error" in row:
            # an out-of-memory row keeps the peak allocated when the allocation failed
            peak = f"{row['peak_gib']:.1f} at the failure" if "peak_gib" in row else ""
            lines.append(
                f"| {row['setting']} | {row['length']:,} | {row['error']} | | | {peak} | {predicted} |{extra}"
            )
            continue
        lines.append(
            f"| {row['setting']} | {row['length']:,} | {row['tokens_per_second_per_gpu']:,.0f} | {row['mfu']:.1%} | "
            f"{row['hfu']:.1%} | {row['peak_gib']:.1f} | {predicted} |{extra}"
        )
    found = features.get("longest")
    if found and "error" not in found:
        lines += [
            "",
            f"- **Longest by the fit:** {found['fitted_candidate']:,} tokens (peaks at "
            f"{', '.join(f'{int(k):,}: {v:.1f} GiB' for k, v in found['fit_points_gib'].items())}; "
            f"usable GPU memory {found['usable_gib']:.1f} GiB; host RAM allows "
            f"{found['host_limit_tokens']:,} tokens"
            + (
                f"; the lease's time allowed {found['time_limit_tokens']:,}"
                if found.get("time_limit_tokens")
                else ""
            )
            + f"); the memory model says {found['memory_model_longest']:,}.",
        ]
    elif found:
        lines += ["", f"- **Longest by the fit:** not found ({found['error']})."]
    return [*lines, ""]


def _attention_ms(top: list[dict[str, Any]]) -> float:
    """Device ms of the attention kernels among a profile's top kernels (FlashAttention-2 or cuDNN's)."""
    return sum(k["ms"] for k in top if "flash" in k["kernel"].lower() or "sdpa" in k["kernel"].lower())


def _strides(strides: dict[str, Any], layers: int | None) -> list[str]:
    lines = [
        "ring-flash-attn's `heads_k_stride` (KV heads its llama3 code takes at a time), cp=1, same model:",
        "",
    ]
    lines += _throughput(strides["throughput"], True, layers)
    profile = strides.get("profile") or {}
    if profile:
        parts = [
            f"{name}: {table['total_ms']:,.0f} ms, attention kernels {_attention_ms(table['top']):,.0f} ms"
            for name, table in profile.items()
        ]
        lines += [
            f"- **Where the time goes** (one step at {strides['profile_length']:,} tokens under torch's profiler, "
            f"device time): {'; '.join(parts)}. The rest of the step is the same kernels for every path.",
            "",
        ]
    return lines


def _cudnn_probe(probe: dict[str, Any]) -> list[str]:
    lines = ["- **cuDNN attention as a kernel for ring-flash-attn** (`benchmarks/gpu/cudnn_probe.py`):"]
    dense = probe.get("dense_forward", {})
    if "error" not in dense:
        lines.append(
            f"  output {dense['out_rel_to_flash']:.1e} from FlashAttention-2's (relative), LSE "
            f"{dense['lse_dtype'].removeprefix('torch.')} shaped {dense['lse_shape']}, {dense['lse_rel_to_flash']:.1e} from FlashAttention-2's;"
        )
    given = probe.get("backward_given_lse", {})
    if given and "error" not in given:
        worst = max(given.values())
        lines.append(
            f"  backward given another kernel's output and LSE (what a ring's merge needs): gradients within {worst:.1e} of FlashAttention-2's;"
        )
    varlen = probe.get("varlen_forward", {})
    for layout, row in varlen.items():
        text = (
            row["error"][:120]
            if "error" in row
            else f"{row['out_rel_to_per_document_flash']:.1e} from per-document FlashAttention-2"
        )
        lines.append(f"  varlen forward (cum_seq_q/k), {layout} layout: {text};")
    timing = probe.get("timing_fwd_bwd", {})
    if timing and "error" not in timing:
        lines.append(
            f"  forward+backward at {timing['tokens']:,} tokens, {timing['heads']} heads: cuDNN {timing['cudnn_ms']:.2f} ms, "
            f"FlashAttention-2 {timing['fa2_ms']:.2f} ms ({timing['ratio_cudnn_to_fa2']:.2f}x the time)."
        )
    return [*lines, ""]
