"""A float64 stand-in for torch's flash-attention ops, with their contract, for CPU runs of the adapter.

``aten::_flash_attention_forward`` / ``_flash_attention_backward`` have no CPU kernels, so the
CPU tests of :mod:`cptune.parallel.kernels.torch_flash` and the CPU dry run of the GPU scripts
substitute :data:`REFERENCE_OPS` for :func:`~cptune.parallel.kernels.torch_flash.flash_ops`
(:func:`substituted`). What it copies from the CUDA ops (torch
2.11-2.14, see the adapter's docstring): the argument lists, dense ``(b, s, h, d)`` / varlen
``(total, h, d)`` inputs, LSE ``(b, h, s)`` / ``(h, total_q)`` in fp32, ``+inf`` LSE and zero
output for rows that see no key, bottom-right masks, GQA, a backward that uses the ``out`` and
LSE it is given (a ring's merged ones) and returns fresh gradients, and the refusals a caller
could trip: a non-unit stride in the head dim, a non-contiguous LSE. Unlike the CUDA ops it takes
any float dtype and computes in float64, so fp32 checks can be exact.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from benchmarks.gpu.reference import attention, visible_keys
from cptune.parallel.kernels import torch_flash
from cptune.parallel.kernels.torch_flash import FlashOps


def _sequences(query, key, cum_seq_q, cum_seq_k):
    """``(q rows, k rows)`` per sequence; dense inputs are one sequence per batch row."""
    if cum_seq_q is None:
        return [((b, slice(None)), (b, slice(None))) for b in range(query.shape[0])]
    pairs = zip(itertools.pairwise(cum_seq_q.tolist()), itertools.pairwise(cum_seq_k.tolist()), strict=True)
    return [(slice(q0, q1), slice(k0, k1)) for (q0, q1), (k0, k1) in pairs]


def _check_strides(**tensors):
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise RuntimeError(f"{name} must have contiguous last dimension")


def _window(is_causal, left, right):
    left = -1 if left is None else left
    return left, 0 if is_causal else (-1 if right is None else right)


def forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
            *, scale=None, window_size_left=None, window_size_right=None):  # fmt: skip
    _check_strides(query=query, key=key, value=value)
    assert dropout_p == 0.0 and not return_debug_mask
    left, right = _window(is_causal, window_size_left, window_size_right)
    out = torch.empty_like(query)
    varlen = cum_seq_q is not None
    lse_shape = (
        (query.shape[1], query.shape[0]) if varlen else (query.shape[0], query.shape[2], query.shape[1])
    )
    lse = torch.empty(lse_shape, dtype=torch.float32, device=query.device)
    for rows_q, rows_k in _sequences(query, key, cum_seq_q, cum_seq_k):
        seq_out, seq_lse = attention(
            query[rows_q][None], key[rows_k][None], value[rows_k][None],
            causal=False, window=(left, right), scale=scale,
        )  # fmt: skip
        out[rows_q] = seq_out[0].to(query.dtype)
        # FlashAttention writes +inf for rows without visible keys (flash_fwd_kernel.h).
        seq_lse = seq_lse[0].float().masked_fill(seq_lse[0] == float("-inf"), float("inf"))
        if varlen:
            lse[:, rows_q] = seq_lse
        else:
            lse[rows_q[0]] = seq_lse
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)
    return (
        out,
        lse,
        rng_state,
        torch.zeros((), dtype=torch.uint64, device=query.device),
        torch.empty(0, dtype=query.dtype),
    )


def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
             is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):  # fmt: skip
    _check_strides(query=query, key=key, value=value, out=out)
    if not logsumexp.is_contiguous():
        raise RuntimeError("the kernel reads the log-sum-exp through a raw pointer: it must be contiguous")
    assert dropout_p == 0.0
    left, right = _window(is_causal, window_size_left, window_size_right)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    grads = [torch.zeros(t.shape, dtype=torch.float64, device=query.device) for t in (query, key, value)]
    group = query.shape[-2] // key.shape[-2]
    for rows_q, rows_k in _sequences(query, key, cum_seq_q, cum_seq_k):
        q, k, v, o, do = (t[rows].double() for t, rows in
                          ((query, rows_q), (key, rows_k), (value, rows_k), (out, rows_q), (grad_out, rows_q)))  # fmt: skip
        lse = (logsumexp[:, rows_q] if cum_seq_q is not None else logsumexp[rows_q[0]]).double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(
            ~visible_keys(q.shape[0], k.shape[0], left, right, q.device), float("-inf")
        )
        # Like the kernel: probabilities from the given LSE; a row with an infinite LSE has none.
        probs = torch.exp(scores - lse.masked_fill(~torch.isfinite(lse), float("inf"))[..., None])
        delta = (do * o).sum(-1).T  # (h, n_q), from the given output
        dprobs = torch.einsum("qhd,khd->hqk", do, v)
        dscores = probs * (dprobs - delta[..., None])
        dq = torch.einsum("hqk,khd->qhd", dscores, k) * scale
        dk = torch.einsum("hqk,qhd->khd", dscores, q) * scale
        dv = torch.einsum("hqk,qhd->khd", probs, do)
        grads[0][rows_q] = dq
        grads[1][rows_k] = dk.unflatten(1, (-1, group)).sum(2)
        grads[2][rows_k] = dv.unflatten(1, (-1, group)).sum(2)
    return tuple(g.to(query.dtype) for g in grads)


REFERENCE_OPS = FlashOps(forward=forward, backward=backward)
"""Substitute for ``torch_flash.flash_ops()`` in CPU runs."""


@contextlib.contextmanager
def substituted() -> Iterator[None]:
    """Run the adapter on CPU: the reference ops, and every tensor counted as one torch's kernels take."""
    saved = torch_flash.flash_ops, torch_flash.runs, torch_flash.unavailable_reason
    torch_flash.flash_ops, torch_flash.runs = (lambda: REFERENCE_OPS), (lambda q: True)
    torch_flash.unavailable_reason = lambda: None
    try:
        yield
    finally:
        torch_flash.flash_ops, torch_flash.runs, torch_flash.unavailable_reason = saved
