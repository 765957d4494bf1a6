"""A training step's memory per token on the 8B-shaped scaled model: peft's LoRA input cast, without it, recomputed norms.

``python -m benchmarks.scaled_step [--tokens 2048 4096] [--layers 2]`` prints, per variant, the traced
step's peak above the state before it (gradients and model exist), per token.

The model and setup are those of :mod:`benchmarks.loss_phase` (Llama-3.1-8B's shape at an eighth of
its width, bf16 under autocast, LoRA r=16 on every linear layer in fp32, gradient checkpointing),
with ``--layers`` decoder layers and every memory feature on: activation offloading, the tiled MLP
(``ceil(tokens / hidden)`` tiles) and the chunked loss. The step's peak is then the backward of a
recomputed layer. The variants:

- *peft*: peft casts each LoRA layer's input to fp32 and autocast casts it back in ``lora_A``,
  which saves that bf16 copy (q, k and v three copies of one tensor);
- *cptune*: with the patch ``lora-input-kept-under-autocast``
  (:func:`cptune.patches.peft_patches.lora_input_cast_patch`, which ``cptune train`` applies to
  a LoRA recipe in bf16): the input is passed as it is where autocast undoes the cast exactly;
- *norms*: *cptune* and ``recompute_norms`` (:mod:`cptune.models.recomputed_norms`): each decoder
  layer's RMSNorms keep their bf16 input instead of its fp32 copy and recompute in the backward.

Per token: the slope between the two lengths, and x 8 for Llama-3.1-8B's width (as in
:mod:`benchmarks.loss_phase`; the per-layer bytes of a step's peak scale with the width, the
attention kernel's few per-head terms do not quite).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.loss_phase import SHAPE, WIDTH_TO_8B, KiB, build
from benchmarks.memtrace import replay, split_events


def step_peak(
    tokens: int, layers: int, patched: bool, seed: int = 0, norms: bool = False
) -> tuple[int, torch.Tensor, dict]:
    """(peak bytes above the start, loss, gradients) of one traced step of ``tokens`` tokens."""
    from cptune.models.offload import enable_activation_offloading
    from cptune.models.recomputed_norms import enable_recomputed_norms
    from cptune.models.tiled_mlp import enable_tiled_mlp
    from cptune.patches.core import PatchSet
    from cptune.patches.peft_patches import lora_input_cast_patch

    shape = {**SHAPE, "num_hidden_layers": layers}
    model, head_loss = build(seed, shape=shape)
    enable_activation_offloading(model)
    enable_tiled_mlp(model, None)
    if norms:
        enable_recomputed_norms(model)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SHAPE["vocab_size"], (1, tokens), generator=generator)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    kwargs = {"input_ids": ids, "position_ids": torch.arange(tokens)[None]}
    patches = PatchSet([lora_input_cast_patch()])

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=False)
        loss, _ = head_loss(model, kwargs, labels)
        loss.backward()
        return loss.detach()

    with patches.applied(_LORA_BF16) if patched else contextlib.nullcontext():
        step()  # the gradients exist from here on: the traced step allocates activations only
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = step()
    peak = replay(*split_events(prof.profiler.kineto_results)).peak
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return peak, loss, grads


class _LoraBf16:
    adapter, bf16, fp16 = "lora", True, False


_LORA_BF16 = _LoraBf16()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaled_step", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tokens", type=int, nargs=2, default=[2048, 4096], metavar=("SHORT", "LONG"))
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    short, long = args.tokens
    results = {}
    for name, patched, norms in (("peft", False, False), ("cptune", True, False), ("norms", True, True)):
        (a, loss, grads), (b, _, _) = (step_peak(t, args.layers, patched, norms=norms) for t in (short, long))
        results[name] = (loss, grads)
        slope = (b - a) / (long - short)
        print(
            f"{name:>6}: step peak {a / KiB:9.1f} KiB at {short} tokens, {b / KiB:9.1f} KiB at {long}; "
            f"{slope / KiB:5.2f} KiB per token at hidden {SHAPE['hidden_size']}, "
            f"{slope * WIDTH_TO_8B / KiB:6.1f} KiB scaled to Llama-3.1-8B"
        )
    (loss_a, grads_a), *others = results.values()
    same = all(
        torch.equal(loss_a, loss_b) and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
        for loss_b, grads_b in others
    )
    print(f"losses and gradients bit-identical between the variants ({short} tokens): {same}")


if __name__ == "__main__":
    main()
