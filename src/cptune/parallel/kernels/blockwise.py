"""Attention forward and backward in plain torch, block by block — the maths of the CPU kernels.

Dense ``(batch, seqlen, nheads, headdim)`` tensors, grouped-query heads, and a
bottom-right aligned window (``left``/``right``, -1 = unbounded; causal is
``right = 0``). Long inputs are processed in blocks of query rows, each against
only the key range it can see, so memory stays bounded and causal masks do about
half the work. :mod:`cptune.parallel.kernels.flash_attn_cpu` wraps these with
flash-attn's signatures and checks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

# Elements of one block of attention scores. Long inputs are processed in query-row blocks so
# the workspace stays small next to the kernel's own inputs (the backward holds about four
# blocks): a block holds at most _SCORES_PER_QUERY_ELEMENT x the elements of q, within the
# bounds below. A fixed budget (it was 2**23) made a CPU dry run's attention workspace the same
# at every cp size, so per-rank memory stopped shrinking with cp (docs/benchmarks.md, section 1).
_SCORES_PER_QUERY_ELEMENT = 4
_MIN_SCORE_ELEMENTS = 1 << 16
_MAX_SCORE_ELEMENTS = 1 << 23


def attend_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, left: int, right: int
) -> tuple[Tensor, Tensor]:
    """Forward on dense ``(b, s, h, d)`` tensors; returns ``out`` in compute dtype and fp32 lse."""
    batch, seqlen_q, nheads, headdim = q.shape
    compute = compute_dtype(q)
    q, k, v = (t.to(compute) for t in (q, k, v))
    q_scaled = q * scale
    out = torch.zeros_like(q)
    lse = q.new_full((batch, nheads, seqlen_q), float("-inf"), dtype=torch.float32)
    for rows, keys, visible in _blocks(q, k, left, right):
        scores = _scores(_grouped(q_scaled[:, rows], k), k[:, keys], visible)
        # Each row divided by its own sum of weights, as softmax and flash-attn's forward normalise it: its
        # weights sum to 1 within the rounding of two sums. Weights exp(scores - lse) would carry lse's rounding
        # (half an ulp of |lse|, not of 1) into the whole row as one scale error, to which some models' gradients
        # are far more sensitive than to independent roundings (test_parity.py's window-gemma3-packed-causal-lora).
        row_max = scores.amax(dim=-1, keepdim=True)
        # A row without keys: max 0, so its weights are exp(-inf) = 0 and its total 0. A row with keys: total >= 1
        # (its largest weight is exp(0)).
        row_max = row_max.masked_fill(~torch.isfinite(row_max), 0.0)
        weights = torch.exp(scores - row_max)
        total = weights.sum(dim=-1)
        blk_out = torch.einsum("bkgqs,bskd->bqkgd", weights, v[:, keys])
        blk_out = blk_out / total.clamp_min(1.0).permute(0, 3, 1, 2)[..., None]  # a row without keys keeps 0
        blk_lse = row_max[..., 0] + torch.log(total)  # log(0) = -inf on a row without keys
        out[:, rows] = blk_out.reshape(batch, -1, nheads, headdim)
        lse[:, :, rows] = blk_lse.reshape(batch, nheads, -1).float()
    return out, lse


def attend_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    left: int,
    right: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward on dense ``(b, s, h, d)`` tensors; returns dq, dk, dv and fp32 softmax_d."""
    batch, _, nheads, headdim = q.shape
    nheads_k = k.shape[2]
    compute = compute_dtype(q)
    dout, q, k, v, out = (t.to(compute) for t in (dout, q, k, v, out))
    q_scaled = q * scale
    # delta_i = dout_i . out_i = sum_j P_ij dP_ij, the rank-one term of the softmax Jacobian.
    delta = (dout * out).sum(dim=-1)
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys, visible in _blocks(q, k, left, right):
        k_blk, v_blk = k[:, keys], v[:, keys]
        q_blk, dout_blk = _grouped(q_scaled[:, rows], k), _grouped(dout[:, rows], k)
        # (b, h, n) -> (b, h_kv, group, n), matching the score layout below.
        lse_blk = lse[:, :, rows].to(compute).reshape(batch, nheads_k, nheads // nheads_k, -1)
        delta_blk = delta[:, rows].reshape(batch, -1, nheads_k, nheads // nheads_k).permute(0, 2, 3, 1)
        scores = _scores(q_blk, k_blk, visible)
        probs = torch.exp(scores - _dead_rows_to_inf(lse_blk)[..., None])
        grad_v[:, keys] += torch.einsum("bkgqs,bqkgd->bskd", probs, dout_blk)
        dprobs = torch.einsum("bqkgd,bskd->bkgqs", dout_blk, v_blk)
        dscores = probs * (dprobs - delta_blk[..., None])
        blk_grad_q = torch.einsum("bkgqs,bskd->bqkgd", dscores, k_blk) * scale
        grad_q[:, rows] = blk_grad_q.reshape(batch, -1, nheads, headdim)
        # q_blk already carries the scale, so this is scale * dS^T q.
        grad_k[:, keys] += torch.einsum("bkgqs,bqkgd->bskd", dscores, q_blk)
    return grad_q, grad_k, grad_v, delta.transpose(1, 2).float()


def _blocks(q: Tensor, k: Tensor, left: int, right: int) -> Iterator[tuple[slice, slice, Tensor | None]]:
    """Split the score matrix into query-row blocks, each with the key range it can see.

    Yields ``(rows, keys, visible)``: the query rows, the smallest key range that holds every
    key those rows may see, and a boolean ``(rows, keys)`` mask (``None`` when all are visible).
    Blocks whose rows see no key are skipped: their ``out`` stays 0 and ``lse`` stays -inf.
    Narrowing the key range is what makes causal and sliding-window attention cheaper here.
    """
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    # Bottom-right alignment: query i sits at key position i + shift.
    shift = seqlen_k - seqlen_q
    rows_per_block = max(1, score_block_elements(q) // max(1, batch * nheads * seqlen_k))
    for start in range(0, seqlen_q, rows_per_block):
        stop = min(seqlen_q, start + rows_per_block)
        first = 0 if left < 0 else max(0, start + shift - left)
        last = seqlen_k if right < 0 else min(seqlen_k, stop - 1 + shift + right + 1)
        if first >= last:
            continue
        visible = None
        if left >= 0 or right >= 0:
            offset = (
                torch.arange(first, last, device=q.device)[None, :]
                - torch.arange(start + shift, stop + shift, device=q.device)[:, None]
            )
            visible = torch.ones_like(offset, dtype=torch.bool)
            if left >= 0:
                visible &= offset >= -left
            if right >= 0:
                visible &= offset <= right
        yield slice(start, stop), slice(first, last), visible


def score_block_elements(q: Tensor) -> int:
    """How many attention scores one block may hold for queries ``q``: proportional to ``q``, bounded."""
    return min(_MAX_SCORE_ELEMENTS, max(_MIN_SCORE_ELEMENTS, _SCORES_PER_QUERY_ELEMENT * q.numel()))


def _scores(q_grouped: Tensor, k: Tensor, visible: Tensor | None) -> Tensor:
    """Masked scores ``(b, h_kv, group, n_q, n_k)`` from grouped, pre-scaled queries."""
    scores = torch.einsum("bqkgd,bskd->bkgqs", q_grouped, k)
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    return scores


def _grouped(x: Tensor, k: Tensor) -> Tensor:
    """View ``(b, n, h, d)`` as ``(b, n, h_kv, group, d)``: query head h reads key head h // group."""
    batch, rows, nheads, headdim = x.shape
    nheads_k = k.shape[2]
    return x.reshape(batch, rows, nheads_k, nheads // nheads_k, headdim)


def _dead_rows_to_inf(lse: Tensor) -> Tensor:
    """Replace non-finite lse by +inf so ``exp(score - lse)`` is 0 on rows that see no key.

    A row without visible keys has scores and lse of -inf; ``-inf - -inf`` would be NaN.
    """
    return lse.masked_fill(~torch.isfinite(lse), float("inf"))


def compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32
