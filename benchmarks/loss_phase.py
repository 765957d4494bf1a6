"""The chunked loss's memory per token on an 8B-shaped scaled model: what the loss phase holds (issue 30).

``python -m benchmarks.loss_phase [--tokens 4096 8192]`` prints, per length and per token.

The model is Llama-3.1-8B's shape at an eighth of its width: hidden 512 = 4 query heads x 128,
one KV head (GQA 4:1), MLP 3.5x (1,792), a vocabulary of 2,048 and one decoder layer; bf16
weights, LoRA r=16 on every linear layer in fp32 (peft's default), the forward under bf16
autocast and the backward outside it (as accelerate runs bf16), gradient checkpointing, and
``cut_cross_entropy`` (:class:`cptune.models.head_loss.HeadLoss`) in chunks of 512 tokens. One
step is traced after a warm-up step with torch's CPU allocator events (as
:mod:`benchmarks.memtrace` does), with markers where the decoder layer's forward ends, where
the loss's forward returns and where the layer's recomputation begins in the backward. The
loss phase is the time between the first and the last of these:

- *held*: what is allocated when the loss's forward returns, above the phase's start: what the
  loss keeps for its backward, beside the last layer's output (allocated before the phase);
- *peak*: the most allocated during the phase above its start. It includes the gradient the
  loss hands back to the last layer (tokens x hidden in bf16, 1 KiB per token here), which
  every loss must.

Per token: the slope between two lengths (one chunk in flight weighs the same at both), and
that slope x 8 for Llama-3.1-8B's width of 4,096 (every per-token byte counted as if it scaled
with the width: the targets' positions and labels, 16 bytes per token, are overstated so).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.memtrace import traced_allocations

SHAPE = {
    "vocab_size": 2048,
    "hidden_size": 512,
    "intermediate_size": 1792,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
}
CHUNK_TOKENS = 512
WIDTH_TO_8B = 4096 / SHAPE["hidden_size"]
KiB = 1024.0

LAYER_START, LAYER_END, LOSS_FORWARD_END = (
    f"cptune_bench::{name}" for name in ("layer", "layer_end", "loss")
)


@dataclass(frozen=True)
class LossPhase:
    """Bytes of one traced step's loss phase (see the module docstring)."""

    tokens: int
    held: int
    peak: int


def build(
    seed: int = 0, chunk_tokens: int = CHUNK_TOKENS, shape: dict[str, int] | None = None
) -> tuple[torch.nn.Module, Any]:
    """The scaled model (:data:`SHAPE`, or ``shape``) with LoRA, in bf16 under autocast, and its chunked loss."""
    from peft import LoraConfig, get_peft_model

    from cptune.models.head_loss import HeadLoss
    from devtools.tiny import build_tiny_model, tiny_llama_config

    config = tiny_llama_config(**(shape or SHAPE))
    model = build_tiny_model(config, seed=seed).to(torch.bfloat16)
    model.config.use_cache = False
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    return model, HeadLoss(model, chunk_elements=chunk_tokens * SHAPE["vocab_size"])


def measure(tokens: int, seed: int = 0, chunk_tokens: int = CHUNK_TOKENS) -> LossPhase:
    """Trace one training step of ``tokens`` tokens (one row, every token but the last a target)."""
    model, head_loss = build(seed, chunk_tokens)
    layer = model.get_base_model().model.layers[-1]
    # transformers checkpoints the layer's forward, inside its hooks: its first norm marks the recomputation.
    layer.input_layernorm.register_forward_pre_hook(lambda module, args: _mark(LAYER_START))
    layer.register_forward_hook(lambda module, args, out: _mark(LAYER_END))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SHAPE["vocab_size"], (1, tokens), generator=generator)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    kwargs = {"input_ids": ids, "position_ids": torch.arange(tokens)[None]}

    def step() -> None:
        loss, _ = head_loss(model, kwargs, labels)
        _mark(LOSS_FORWARD_END)
        loss.backward()

    step()  # the gradients exist from here on: the traced step allocates activations only
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return phase_of(tokens, prof.profiler.kineto_results)


def phase_of(tokens: int, result: Any) -> LossPhase:
    """The loss phase of one traced step from its allocator events and markers."""
    memory, marks = traced_allocations(result), []
    for event in result.events():
        name = event.name()
        if name in (LAYER_START, LAYER_END, LOSS_FORWARD_END):
            marks.append((event.start_ns(), name))
    marks.sort()
    names = [name for _, name in marks]
    # Forward: layer start, layer end (the phase starts), loss; backward: the layer's recomputation.
    if names[:4] != [LAYER_START, LAYER_END, LOSS_FORWARD_END, LAYER_START]:
        raise RuntimeError(f"unexpected markers: {names}")
    start, held_at, end = marks[1][0], marks[2][0], marks[3][0]
    level = at_start = at_held = peak = 0
    for when, nbytes in sorted(memory):
        if when > end:
            break
        level += nbytes
        if when <= start:
            at_start = level
        elif when <= held_at:
            at_held = level
        peak = max(peak, level) if when > start else peak
    return LossPhase(tokens=tokens, held=at_held - at_start, peak=max(peak, at_start) - at_start)


def _mark(name: str) -> None:
    with record_function(name):
        pass


def per_token(short: LossPhase, long: LossPhase) -> dict[str, float]:
    """Bytes per token: the slope between the two lengths."""
    span = long.tokens - short.tokens
    return {"held": (long.held - short.held) / span, "peak": (long.peak - short.peak) / span}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.loss_phase", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tokens", type=int, nargs=2, default=[4096, 8192], metavar=("SHORT", "LONG"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    short, long = (measure(tokens) for tokens in args.tokens)
    for phase in (short, long):
        print(
            f"{phase.tokens:>6} tokens: held {phase.held / KiB:10.1f} KiB, peak {phase.peak / KiB:10.1f} KiB"
        )
    slope = per_token(short, long)
    for name, value in slope.items():
        print(
            f"{name:>4} per token: {value / KiB:6.2f} KiB at hidden {SHAPE['hidden_size']}, "
            f"{value * WIDTH_TO_8B / KiB:6.1f} KiB scaled to Llama-3.1-8B"
        )


if __name__ == "__main__":
    main()
