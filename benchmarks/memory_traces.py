"""Tracing for :mod:`benchmarks.memory_coefficients`: one training step's phase peaks, and the attention backward's.

The cases, shapes and settings are :mod:`benchmarks.memory_coefficients`'; this module holds what
needs torch (the traces themselves), so that the fit and its test stay pure arithmetic.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.memory_coefficients import (
    CASES,
    CHUNK_TOKENS,
    HEAD_DIM,
    LENGTHS,
    LORA_RANK,
    PHASES,
    SETTINGS,
    TRACED_SHAPES,
    TRACES,
    VOCAB,
    Setting,
    planned_traces,
)


def trace(setting: Setting, shape: dict[str, int], layers: int, tokens: int, seed: int = 0) -> dict[str, Any]:
    """Peak bytes of each phase of one traced training step, above the bytes allocated when it began."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.scaled_step import _LORA_BF16
    from cptune.models.head_loss import HeadLoss
    from cptune.models.offload import enable_activation_offloading
    from cptune.models.recomputed_norms import enable_recomputed_norms
    from cptune.models.tiled_mlp import enable_tiled_mlp
    from cptune.parallel.loss import token_loss_sum
    from cptune.patches.core import PatchSet
    from cptune.patches.peft_patches import lora_input_cast_patch
    from devtools.tiny import build_tiny_model, tiny_llama_config

    vocab = shape.get("vocab_size", VOCAB)
    widths = {k: v for k, v in shape.items() if k not in ("vocab_size", "head_dim")}
    head_dim = shape.get("head_dim", HEAD_DIM)
    config = tiny_llama_config(vocab, **widths, num_hidden_layers=layers, head_dim=head_dim)
    model = build_tiny_model(config, seed=seed)
    if not setting.fp32:
        model = model.to(torch.bfloat16)
    model.config.use_cache = False
    if setting.checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if setting.lora:
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=32, target_modules="all-linear"))
    if setting.autocast:
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
        if setting.loss != "head":  # accelerate hands the Trainer the model's outputs in fp32
            from accelerate.utils import convert_outputs_to_fp32

            model.forward = convert_outputs_to_fp32(model.forward)
    if setting.offload:
        enable_activation_offloading(model)
    if setting.tiled:
        enable_tiled_mlp(model, None)
    if setting.norms:
        enable_recomputed_norms(model)
    head_loss = HeadLoss(model, chunk_elements=CHUNK_TOKENS * VOCAB) if setting.loss == "head" else None
    chunk_elements = CHUNK_TOKENS * VOCAB if setting.loss == "chunked" else 1 << 62

    def mark(name: str) -> None:
        with record_function(f"cptune_bench::{name}"):
            pass

    decoder = model.get_base_model() if setting.lora else model
    for layer in decoder.model.layers:
        layer.input_layernorm.register_forward_pre_hook(lambda module, args: mark("layer"))
        layer.register_forward_hook(lambda module, args, out: mark("layer_end"))
    if not setting.checkpointing:
        # Nothing is recomputed, so the loss phase ends where the last layer's output receives its gradient.
        def mark_backward(module: Any, args: Any, out: Any) -> None:
            if torch.is_grad_enabled():
                (out[0] if isinstance(out, tuple) else out).register_hook(lambda grad: mark("backward"))

        decoder.model.layers[-1].register_forward_hook(mark_backward)
    ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(seed))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    kwargs = {"input_ids": ids, "position_ids": torch.arange(tokens)[None]}

    def step() -> None:
        if head_loss is not None:
            loss, _ = head_loss(model, kwargs, labels)
        else:
            loss = token_loss_sum(model(**kwargs).logits, labels, chunk_elements)
        mark("loss")
        loss.backward()

    patched = setting.lora and setting.patched and setting.autocast
    with PatchSet([lora_input_cast_patch()]).applied(_LORA_BF16) if patched else contextlib.nullcontext():
        step()  # the gradients exist from here on: the traced step allocates activations only
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    return phase_peaks(prof.profiler.kineto_results)


def phase_peaks(result: Any) -> dict[str, Any]:
    """The peak of each phase (forward, loss, layer backward) from a step's allocator events and markers, and
    under ``moments`` where each peak is (:func:`moment_at`): two traces whose peaks are the same moment
    grow by the same bytes per token between them."""
    from benchmarks.memtrace import traced_allocations

    memory, marks, ops = traced_allocations(result), [], []
    for event in result.events():
        name = event.name()
        if name.startswith("cptune_bench::"):
            marks.append((event.start_ns(), name.removeprefix("cptune_bench::")))
        elif name.startswith(("aten::", "autograd::engine::evaluate_function: ")):
            ops.append((event.start_ns(), event.end_ns(), name))
    marks.sort()
    names = [name for _, name in marks]
    loss_at = names.index("loss")
    forward_end = max(i for i in range(loss_at) if names[i] == "layer_end")
    # The first layer recomputed in the backward; without gradient checkpointing, the backward marker.
    backward_start = next(i for i in range(loss_at, len(names)) if names[i] in ("layer", "backward"))
    bounds = (marks[forward_end][0], marks[backward_start][0])
    level, peaks, when_peaked = 0, dict.fromkeys(PHASES, 0), dict.fromkeys(PHASES, 0)
    for when, nbytes in sorted(memory):
        level += nbytes
        phase = "forward" if when <= bounds[0] else "loss" if when < bounds[1] else "backward"
        if level > peaks[phase]:
            peaks[phase], when_peaked[phase] = level, when
    return {**peaks, "moments": {phase: moment_at(ops, when_peaked[phase]) for phase in PHASES}}


def moment_at(ops: list[tuple[int, int, str]], when: int) -> str:
    """Where an allocation at ``when`` happened: the autograd nodes being run (the backward's, outermost
    first), then the innermost aten op, e.g. ``_TiledMlpFunctionBackward > MulBackward0 > aten::mul``."""
    around = sorted(((end - start, name) for start, end, name in ops if start <= when <= end), reverse=True)
    nodes = [
        n.removeprefix("autograd::engine::evaluate_function: ")
        for _, n in around
        if n.startswith("autograd::")
    ]
    op = [n for _, n in around if n.startswith("aten::")][-1:]
    return " > ".join(nodes + op) or "-"


def attention_backward_peaks(heads: int = 4, kv_heads: int = 1) -> dict[str, int]:
    """Peak bytes of torch's CPU attention backward (SDPA, GQA, causal, bf16) at both lengths, above its start.

    What a layer's trace holds of the attention backward, beside the gradients of q, k and v: the
    expanded dK or dV (one query-width row per token at a time). FlashAttention-2 on a GPU holds both
    and an fp32 dQ accumulator (:func:`cptune.parallel.memory.flash_backward_bytes` adds the difference).
    """
    import torch

    from benchmarks.memtrace import AllocationTrace

    torch.set_num_threads(1)
    peaks = {}
    for tokens in LENGTHS:
        q = torch.randn(1, heads, tokens, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
        k, v = (
            torch.randn(1, kv_heads, tokens, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True) for _ in "kv"
        )
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        gradient = torch.ones_like(out)
        with AllocationTrace() as trace_:
            out.backward(gradient)
        peaks[str(tokens)] = trace_.result.peak
    return peaks


def trace_all(path: Path = TRACES, cases: list[tuple[str, str, int]] = CASES) -> None:
    """Trace every case at its lengths (:func:`~benchmarks.memory_coefficients.planned_traces`) and write the peaks
    after each trace (traces already in ``path`` are kept and skipped)."""
    import peft
    import torch
    import transformers

    torch.set_num_threads(1)
    previous = json.loads(path.read_text()) if path.exists() else {}
    done = previous.get("traces", [])
    attention = previous.get("attention_backward") or attention_backward_peaks()
    have = {(t["setting"], t["shape"], t["layers"], t["tokens"]) for t in done}
    for name, shape, layers, tokens in planned_traces(cases):
        if (name, shape, layers, tokens) not in have:
            peaks = trace(SETTINGS[name], TRACED_SHAPES[shape], layers, tokens)
            done.append({"setting": name, "shape": shape, "layers": layers, "tokens": tokens, **peaks})
            print(f"{name:>22} {shape:>6} L={layers} T={tokens}: {peaks}", flush=True)
            about = {
                "command": "python -m benchmarks.memory_coefficients trace",
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
                "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                f"peft {peft.__version__}",
                "shapes": TRACED_SHAPES,
                "settings": {k: asdict(v) for k, v in SETTINGS.items()},
                "head_dim": HEAD_DIM,
                "vocab": VOCAB,
                "chunk_tokens": CHUNK_TOKENS,
            }
            record = {"about": about, "attention_backward": attention, "traces": done}
            path.write_text(json.dumps(record, indent=1) + "\n")
