"""A packed row's step memory at cp=1: transformers' sdpa with its mask against cptune's document attention.

``python -m benchmarks.packed_cp1 [--tokens 2048 4096] [--document 256]`` prints, per path and length,
the traced step's peak above the state before it, and what it grows by per token.

The model and setup are those of :mod:`benchmarks.loss_phase` (Llama-3.1-8B's shape at an eighth of
its width, bf16 under autocast, LoRA r=16 in fp32, gradient checkpointing, the chunked loss); one
row of ``tokens`` tokens packed with documents of ``--document`` tokens, through
:class:`cptune.parallel.backends.local.sharding.LocalBackend`:

- *masked*: transformers' ``sdpa``, which keeps the documents apart through a boolean
  ``tokens x tokens`` mask, built again by each forward (the checkpointed layers' recomputation too);
- *documents*: ``LocalBackend(documents=True)``, what ``cptune train`` runs at cp=1 for such a model:
  one SDPA call per document here (one varlen FlashAttention-2 call on a GPU), no mask.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.loss_phase import SHAPE, KiB, build
from benchmarks.memtrace import AllocationTrace


def step_peak(tokens: int, document: int, documents: bool, seed: int = 0) -> tuple[int, torch.Tensor]:
    """(peak bytes above the start, loss) of one traced step of one packed row of ``tokens`` tokens."""
    from cptune.parallel.backends.attention import register_attention
    from cptune.parallel.backends.local.sharding import LocalBackend
    from cptune.parallel.shard import TokenBatch

    register_attention()
    model, head_loss = build(seed)
    backend = LocalBackend(causal=True, documents=documents)
    model.set_attn_implementation(backend.attn_implementation)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SHAPE["vocab_size"], (1, tokens), generator=generator)
    positions = (torch.arange(tokens) % document)[None]
    labels = ids.roll(-1, 1)
    labels[(positions.roll(-1, 1) == 0)] = -100  # a document's last token predicts nothing
    batch = TokenBatch(ids, positions, labels)

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=False)
        sharded = backend.shard(batch)
        loss, _ = head_loss(model, sharded.model_kwargs, sharded.shift_labels)
        loss.backward()
        return loss.detach()

    step()  # the gradients exist from here on: the traced step allocates activations only
    with AllocationTrace() as trace:
        loss = step()
    return trace.result.peak, loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.packed_cp1", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tokens", type=int, nargs=2, default=[2048, 4096], metavar=("SHORT", "LONG"))
    parser.add_argument("--document", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    short, long = args.tokens
    losses = {}
    for name, documents in (("masked", False), ("documents", True)):
        (a, loss), (b, _) = (step_peak(t, args.document, documents) for t in (short, long))
        losses[name] = loss
        print(
            f"{name:>9}: step peak {a / KiB:9.1f} KiB at {short} tokens, {b / KiB:9.1f} KiB at {long}; "
            f"{(b - a) / (long - short) / KiB:6.2f} KiB per token between them"
        )
    print(
        f"losses (bf16 step, {short} tokens): " + ", ".join(f"{n} {float(v):.6f}" for n, v in losses.items())
    )


if __name__ == "__main__":
    main()
