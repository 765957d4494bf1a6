"""Recomputed norms: each decoder layer's RMSNorms keep their input, not an fp32 copy of it.

transformers' RMSNorm (Llama, Qwen, Mistral...) upcasts its input to fp32 before it squares and
normalises it, and autograd keeps that fp32 copy for the backward: 4 bytes per hidden unit and
token, 16 KiB per token per norm at Llama-3.1-8B's width, two norms per layer (Qwen3's per-head
q/k norms too), where the bf16 input a recomputation needs is half that, or nothing when it is
kept anyway (the first norm's input is the layer's input, which checkpointing keeps).

:class:`RecomputedNorm` runs a norm like :mod:`cptune.models.tiled_mlp` runs an MLP: the forward
under ``no_grad`` keeps only the input, and the backward calls the norm's own ``forward`` again under
the forward's autocast, tile by tile of the tokens, and backpropagates through it. The tiles matter:
a norm's backward over the whole sequence makes several fp32 tensors of its size at once, at the
moment a step peaks (the backward of a recomputed layer). It is the same
computation on the same values, so the output and the input's gradient are bit for bit those of
the norm run as it is, and so is the weight's gradient in one tile; over several tiles (more tokens
than the norm is wide) a trained weight's gradient is summed tile by tile: the same terms in
another order (tests/models/test_recomputed_norms.py). A norm whose
input is already fp32 runs as it is: its upcast is no copy, so autograd keeps nothing a recomputation
would spare. The hooks go on the module, so whatever wraps it (peft, FSDP2, DeepSpeed) sees it called as
usual. Under DeepSpeed ZeRO-3 the norm's weight is partitioned: ZeRO-3 gathers it for the norm's backward,
which is where the recomputation runs, and a trained weight gets its gradient summed over the tiles there,
while ZeRO-3 still holds it whole (:func:`cptune.parallel.backends.zero3_params.gathered`; checked in bf16
under ZeRO-3 by tests/parallel/test_ulysses_parity.py).
"""

from __future__ import annotations

import torch

from cptune.models.tiled_mlp import tiled_mlp
from cptune.parallel.memory import mlp_tiles


def decoder_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The RMSNorm modules inside the decoder layers (the model's ``_no_split_modules`` classes).

    The final norm is left alone: the chunked loss (``cut_cross_entropy``) recomputes it per chunk.

    Raises:
        ValueError: the model has no such layers, or no RMSNorm in them.
    """
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    norms = [m for layer in layers for m in layer.modules() if type(m).__name__.endswith("RMSNorm")]
    if not norms:
        raise ValueError("its decoder layers have no RMSNorm module")
    return norms


class RecomputedNorm:
    """Hooks that make one norm module keep its input and recompute in the backward; :meth:`remove` takes them off."""

    def __init__(self, norm: torch.nn.Module):
        self.norm = norm
        self._input: torch.Tensor | None = None
        self._handles = [
            norm.register_forward_pre_hook(self._before),
            norm.register_forward_hook(self._after),
        ]

    def _before(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise TypeError(
                f"recompute_norms: {type(module).__name__} was called with {len(args)} inputs; it takes one"
            )
        (x,) = args
        if not torch.is_grad_enabled() or x.dtype == torch.float32:
            # Nothing is saved, or the upcast is no copy: autograd keeps the input itself, as this would
            # (recomputing would only regroup the three terms of the input's gradient). The norm runs as it is.
            return None
        self._input = x
        # The norm's own forward sees no tokens; the forward hook computes the real result.
        return (x.narrow(-2, 0, 0),)

    def _after(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        x, self._input = self._input, None
        if x is None:
            return None
        params = [p for p in module.parameters() if p.requires_grad]
        # The recomputation's fp32 temporaries (the upcast, the normalised input, their gradients) would
        # otherwise all exist at once, in the backward of a recomputed layer, where a step peaks. A norm
        # is token-wise: tiles of ceil(tokens / width) give each token the same bits; only a trained
        # weight's gradient (a full fine-tune) is summed tile by tile, as the tiled MLP's are.
        return tiled_mlp(module.forward, x, mlp_tiles(x.shape[-2], x.shape[-1]), params)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def enable_recomputed_norms(model: torch.nn.Module) -> list[RecomputedNorm]:
    """Recompute every RMSNorm of ``model``'s decoder layers in the backward (``recompute_norms: true``)."""
    return [RecomputedNorm(norm) for norm in decoder_norms(model)]
