"""Attention sinks (gpt-oss): a learned logit per head in every query's softmax, exact forward and backward.

gpt-oss appends one logit ``s_h`` per head to each query's scores and drops it from the output
(transformers' ``modeling_gpt_oss.eager_attention_forward``). With ``Z = Σ_j exp(S_ij)`` over the keys
the query sees, ``lse = log Z`` and ``out`` the ordinary attention output::

    out_sink = Σ_j exp(S_ij) v_j / (Z + exp(s_h)) = out · Z / (Z + exp(s_h)) = out · σ(lse - s_h)

so the sink is applied once to the finished ``(out, lse)`` of the ordinary attention, after every
key block has been merged (a sink applied per block would enter the denominator once per block).
It is attention with the log-sum-exp ``lse_sink = log(Z + exp(s_h))``: probabilities
``P'_ij = exp(S_ij - lse_sink)`` and ``out_sink = Σ_j P'_ij v_j``. A flash-attention backward reads
the forward's ``out`` only for ``D_i = dout_i · out_i`` and ``lse`` only to rebuild ``P``, so the
ordinary kernels' backward given ``(out_sink, lse_sink)`` is exactly the sink attention's backward
for ``q``, ``k`` and ``v``. The sink's own gradient, with ``p_i = exp(s_h - lse_sink_i)`` its
probability, is ``dL/ds_h = -Σ_i p_i · D_i`` over this process's queries: under context parallelism
each rank sums its own queries and the gradient reduction over the ranks adds the rest, as for any
parameter.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor


class SplitAttention(Protocol):
    """An attention computed by a forward that returns its log-sum-exp and a flash-style backward.

    Layouts are flash-attn's: varlen ``q`` ``(tokens, heads, head_dim)``, ``k``, ``v``
    ``(tokens_k, kv_heads, head_dim)``, ``lse`` ``(heads, tokens)``; or batched, with a leading batch dim on
    each (``lse`` ``(batch, heads, tokens)``). ``lse`` in fp32 (or float64); ``out`` in ``q``'s dtype or wider.
    """

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of ordinary attention, every key block already merged."""
        ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of the attention whose output and log-sum-exp are ``out`` and ``lse``."""
        ...


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """The sink attention's ``(out_sink, lse_sink)`` from ordinary attention's merged ``(out, lse)``.

    Args:
        out: ``(tokens, heads, head_dim)``, or ``(batch, tokens, heads, head_dim)``.
        lse: ``(heads, tokens)`` (``(batch, heads, tokens)``); ``-inf`` for a query that sees no key (its output
            stays 0).
        sinks: ``(heads,)`` sink logits.
    """
    sinks = sinks.to(lse.dtype)[:, None]
    lse_sink = torch.logaddexp(lse, sinks)
    # σ(lse - s), the share of the softmax the keys keep, from the difference itself: exp(lse - lse_sink) would
    # carry lse_sink's rounding (half an ulp of |lse_sink|) into the whole row as one scale error. σ(-inf) = 0.
    kept = torch.sigmoid(lse - sinks)
    compute = torch.promote_types(out.dtype, kept.dtype)
    kept = kept.transpose(-1, -2)[..., None].to(compute)
    return (out.to(compute) * kept).to(out.dtype), lse_sink


def sink_gradient(dout: Tensor, out_sink: Tensor, lse_sink: Tensor, sinks: Tensor) -> Tensor:
    """``dL/ds`` summed over this call's queries: ``-Σ_i exp(s - lse_sink_i) · (dout_i · out_sink_i)``."""
    compute = lse_sink.dtype
    delta = (
        (dout.to(compute) * out_sink.to(compute)).sum(dim=-1).transpose(-1, -2)
    )  # ([batch,] heads, tokens)
    sink_share = torch.exp(sinks.to(compute)[:, None] - lse_sink)
    per_head = (sink_share * delta).sum(dim=-1).reshape(-1, sinks.shape[0]).sum(dim=0)
    return -per_head.to(sinks.dtype)


class _AttentionWithSinks(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, attention: SplitAttention, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor
    ) -> Tensor:
        out, lse = attention.forward(q, k, v)
        out, lse = with_sinks(out, lse, sinks.detach())
        out = out.to(q.dtype)  # one rounding, after the sink, where the attention's merge kept a wider out
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.attention = attention
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.attention.backward(dout, q, k, v, out, lse)
        dsinks = sink_gradient(dout, out, lse, sinks) if ctx.needs_input_grad[4] else None
        return None, dq, dk, dv, dsinks


def attention_with_sinks(attention: SplitAttention, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor) -> Tensor:
    """``attention`` with a sink logit per head (``sinks``, ``(heads,)``), differentiable in all four inputs."""
    return _AttentionWithSinks.apply(attention, q, k, v, sinks)
