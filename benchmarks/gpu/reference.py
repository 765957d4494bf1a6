"""Attention in float64 the plain way: the reference for every kernel check, on CPU and GPU.

``softmax(scale * q k^T + mask) v`` per sequence, with flash-attn's conventions: tensors
``(batch, seqlen, nheads, headdim)``, query head ``h`` reads key head ``h // (nheads // nheads_k)``,
masks bottom-right aligned (query ``i`` sits at key position ``i + seqlen_k - seqlen_q``; it sees
keys ``[p - left, p + right]``, -1 = unbounded, causal = ``right = 0``). A query that sees no key
gets output 0 and log-sum-exp ``-inf``. Differentiable: gradients come from autograd.
"""

from __future__ import annotations

import itertools
from typing import Any


def visible_keys(seqlen_q: int, seqlen_k: int, left: int, right: int, device: Any = None) -> Any:
    """Boolean ``(seqlen_q, seqlen_k)``: which keys each query sees (bottom-right aligned window)."""
    import torch

    position = torch.arange(seqlen_q, device=device)[:, None] + seqlen_k - seqlen_q
    key = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= key >= position - left
    if right >= 0:
        visible &= key <= position + right
    return visible


def attention(q: Any, k: Any, v: Any, *, causal: bool, window: tuple[int, int] = (-1, -1), scale: Any = None):
    """Dense reference in float64: ``(out (b, s_q, h, d), lse (b, h, s_q))``."""
    import torch

    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    left, right = window[0], 0 if causal else window[1]
    scores = scores.masked_fill(~visible_keys(q.shape[1], k.shape[1], left, right, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without keys: 0, not NaN
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def varlen_attention(q: Any, k: Any, v: Any, cu_seqlens_q: list[int], cu_seqlens_k: list[int], **mask: Any):
    """Packed reference: ``(out (total_q, h, d), lse (h, total_q))``, each sequence on its own."""
    import torch

    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(
        itertools.pairwise(cu_seqlens_q), itertools.pairwise(cu_seqlens_k), strict=True
    ):
        out, lse = attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **mask)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def relative_error(actual: Any, expected: Any) -> float:
    """``||actual - expected|| / ||expected||`` over finite reference entries (METHOD.md's measure)."""
    import torch

    finite = torch.isfinite(expected)
    same_infinities = torch.equal(actual[~finite].double(), expected[~finite].double())
    if not torch.equal(torch.isfinite(actual), finite) or not same_infinities:
        return float("inf")  # a NaN, or an infinity where the reference has none or another one
    difference = (actual.double() - expected.double())[finite]
    norm = expected.double()[finite].norm()
    return float(difference.norm() / norm) if norm > 0 else float(difference.norm())
