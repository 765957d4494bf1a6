"""Differentiable attention over packed documents, on the kernels :mod:`.dispatch` picks.

One call attends every document of a packed ``(total, heads, head_dim)`` tensor within itself
(``cu_seqlens`` offsets, bottom-right causal masks, sliding windows, grouped-query heads): PyTorch's
FlashAttention-2 on CUDA in bf16/fp16, the pure-PyTorch stand-ins elsewhere. The DeepSpeed
backend's document-aware core attention uses it on GPUs instead of one SDPA call per document.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cptune.parallel.kernels import dispatch


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                scale: float | None, causal: bool, left: int) -> Tensor:  # fmt: skip
        out, lse, _, _ = dispatch._flash_attn_varlen_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, scale, causal, left, -1
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.scale, ctx.causal, ctx.left = max_seqlen, scale, causal, left
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        dispatch._flash_attn_varlen_backward(
            dout.contiguous(), q, k, v, out, lse, dq, dk, dv, cu_seqlens, cu_seqlens, ctx.max_seqlen,
            ctx.max_seqlen, 0.0, ctx.scale, ctx.causal, ctx.left, -1, 0.0, None, False,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None


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
) -> Tensor:
    """Attention within each document of packed ``q`` ``(total, h, d)``, ``k``, ``v`` ``(total, h_kv, d)``.

    Args:
        cu_seqlens: int32 document offsets ``[0, ..., total]`` on ``q``'s device.
        max_seqlen: The longest document.
        scale: Scale of ``q k^T`` (``None``: ``head_dim ** -0.5``).
        causal: Causal within each document; otherwise bidirectional within it.
        window: transformers' ``sliding_window``: a query sees the ``window`` keys up to its own
            (flash-attn's ``window_size_left = window - 1``); causal only. None: no window.
    """
    if window is not None and not causal:
        raise ValueError("varlen_attention takes a sliding window with causal attention only.")
    left = -1 if window is None else int(window) - 1
    return _VarlenAttention.apply(q, k, v, cu_seqlens, int(max_seqlen), scale, causal, left)
