"""Differentiable attention over packed documents, on the kernels :mod:`.dispatch` picks.

One call attends every document of a packed ``(total, heads, head_dim)`` tensor within itself
(``cu_seqlens`` offsets, bottom-right causal masks, sliding windows, grouped-query heads): PyTorch's
FlashAttention-2 on CUDA in bf16/fp16, the pure-PyTorch stand-ins elsewhere. The DeepSpeed
backend's document-aware core attention uses it on GPUs instead of one SDPA call per document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cptune.parallel.kernels import dispatch
from cptune.parallel.kernels.sinks import attention_with_sinks


@dataclass(frozen=True)
class VarlenKernel:
    """The varlen kernels over packed documents as a :class:`~cptune.parallel.kernels.sinks.SplitAttention`:
    ``(out, lse)`` forward and a backward from them, ``kv_heads_per_call`` KV heads per kernel call."""

    cu_seqlens: Tensor
    max_seqlen: int
    scale: float | None
    causal: bool
    left: int
    kv_heads_per_call: int

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        outs, lses = [], []
        for q_heads, kv_heads in _head_groups(q, k, self.kv_heads_per_call):
            out, lse, _, _ = dispatch._flash_attn_varlen_forward(
                q[:, q_heads], k[:, kv_heads], v[:, kv_heads], self.cu_seqlens, self.cu_seqlens, self.max_seqlen,
                self.max_seqlen, 0.0, self.scale, self.causal, self.left, -1,
            )  # fmt: skip
            outs.append(out)
            lses.append(lse)
        # One group: the kernel's own tensors. Several: whole (total, h, d) and (h, total) as one call gives.
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=0)
        return out, lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        # Each group's call writes its heads' rows of dq, dk and dv: its dK/dV expansion for grouped-query
        # heads and its fp32 dQ accumulator cover that group only.
        for q_heads, kv_heads in _head_groups(q, k, self.kv_heads_per_call):
            dispatch._flash_attn_varlen_backward(
                dout[:, q_heads], q[:, q_heads], k[:, kv_heads], v[:, kv_heads], out[:, q_heads], lse[q_heads],
                dq[:, q_heads], dk[:, kv_heads], dv[:, kv_heads], self.cu_seqlens, self.cu_seqlens,
                self.max_seqlen, self.max_seqlen, 0.0, self.scale, self.causal, self.left, -1, 0.0, None, False,
            )  # fmt: skip
        return dq, dk, dv


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, kernel: VarlenKernel, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out, lse = kernel.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        return None, *ctx.kernel.backward(dout.contiguous(), q, k, v, out, lse)


def _head_groups(q: Tensor, k: Tensor, kv_heads_per_call: int) -> list[tuple[slice, slice]]:
    """(query heads, KV heads) of each kernel call: ``kv_heads_per_call`` KV heads and their query heads at a time."""
    kv_heads = k.shape[1]
    per_kv = q.shape[1] // kv_heads
    step = min(kv_heads_per_call, kv_heads) if kv_heads_per_call > 0 else kv_heads
    return [
        (
            slice(first * per_kv, min(first + step, kv_heads) * per_kv),
            slice(first, min(first + step, kv_heads)),
        )
        for first in range(0, kv_heads, step)
    ]


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    scale: float | None,
    causal: bool,
    window: int | None = None,
    kv_heads_per_call: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention within each document of packed ``q`` ``(total, h, d)``, ``k``, ``v`` ``(total, h_kv, d)``.

    Args:
        cu_seqlens: int32 document offsets ``[0, ..., total]`` on ``q``'s device.
        max_seqlen: The longest document.
        scale: Scale of ``q k^T`` (``None``: ``head_dim ** -0.5``).
        causal: Causal within each document; otherwise bidirectional within it.
        window: transformers' ``sliding_window``: a query sees the ``window`` keys up to its own
            (flash-attn's ``window_size_left = window - 1``); causal only. None: no window.
        kv_heads_per_call: Call the kernel for this many KV heads (and their query heads) at a time
            (``None``: all in one call). Heads are independent, so the result is the same; the
            backward's per-call buffers (FlashAttention-2's fp32 dQ accumulator, and dK/dV expanded to
            the query heads for grouped-query attention) then cover one group instead of every head.
        sinks: gpt-oss's sink logits, one per query head (``(h,)``), each in its head's softmax
            (:mod:`cptune.parallel.kernels.sinks`); None: none.
    """
    if window is not None and not causal:
        raise ValueError("varlen_attention takes a sliding window with causal attention only.")
    left = -1 if window is None else int(window) - 1
    kernel = VarlenKernel(cu_seqlens, int(max_seqlen), scale, causal, left, kv_heads_per_call or 0)
    if sinks is not None:
        return attention_with_sinks(kernel, q, k, v, sinks)
    return _VarlenAttention.apply(kernel, q, k, v)
