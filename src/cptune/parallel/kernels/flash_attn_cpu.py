"""Pure-torch stand-ins for the private kernels of flash-attn 2.8.

ring-flash-attn 0.1.8 builds its context-parallel attention from four private functions of
``flash_attn.flash_attn_interface``. This module implements them in plain torch with flash-attn
2.8.3's signatures and conventions, so that ring-flash-attn's own code runs on CPU (gloo):

* ``q`` is ``(batch, seqlen_q, nheads, headdim)`` (dense) or ``(total_q, nheads, headdim)``
  (varlen); ``k``, ``v`` have ``nheads_k`` heads and query head ``h`` reads key head
  ``h // (nheads // nheads_k)`` (grouped-query attention).
* ``softmax_lse`` is fp32, ``(batch, nheads, seqlen_q)`` dense or ``(nheads, total_q)`` varlen.
* Masks are bottom-right aligned: query ``i`` sits at key position ``p = i + seqlen_k - seqlen_q``
  (per sequence) and sees keys ``[p - window_size_left, p + window_size_right]``; -1 means
  unbounded and ``causal`` means ``window_size_right = 0``.
* Varlen sequence ``i`` is ``q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]`` against the same slice of
  ``k`` by ``cu_seqlens_k`` (int32).

Deliberate differences from flash-attn:

* fp32 and fp64 inputs are accepted (flash-attn takes fp16/bf16 only) so CPU tests can be exact.
  Arithmetic is fp32 (fp64 for fp64 inputs); outputs and gradients are cast back.
* A query row that sees no key gets ``out = 0`` and ``lse = -inf``. flash-attn writes ``+inf``,
  with which ring-flash-attn's merge (``ring_flash_attn/utils.py:47-48``) would overwrite the
  running output with the empty block's zeros; ``-inf`` leaves it untouched.
* ``softmax_d`` has the shape of ``softmax_lse`` (flash-attn pads it). Wrong offsets or a
  sequence longer than ``max_seqlen_q/k`` raise ``ValueError`` (flash-attn reads garbage).
* dropout, softcapping, ALiBi, ``return_softmax``, paged KV (``block_table``), ``leftpad_k`` and
  ``seqused_k`` raise ``NotImplementedError``; ``deterministic`` and ``rng_state`` are ignored.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from cptune.parallel.kernels.blockwise import attend_backward, attend_forward
from cptune.parallel.kernels.contract import (
    check_qkv,
    reject_unsupported,
    resolve_scale,
    resolve_window,
    write_gradients,
)

KERNELS = "cptune's CPU stand-in for flash-attn"


def _flash_attn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    return_softmax: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dense attention forward (flash-attn 2.8 signature; see the module docstring).

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``; ``k``, ``v``: ``(batch, seqlen_k, nheads_k, headdim)``.
        softmax_scale: Scale of ``q @ k^T``; ``None`` means ``headdim ** -0.5``.
        causal: Bottom-right aligned causal mask.
        window_size_left: Sliding window left of the diagonal (and ``window_size_right``
            right of it), -1 for none.
        dropout_p: Must be 0; so must ``softcap``; ``alibi_slopes`` must be ``None`` and
            ``return_softmax`` false.

    Returns:
        ``(out, softmax_lse, S_dmask, rng_state)``: ``out`` like ``q``, fp32 ``softmax_lse``
        ``(batch, nheads, seqlen_q)``, and the empty ``S_dmask`` and unused ``rng_state`` that
        flash-attn returns without dropout.

    Raises:
        NotImplementedError: For an unsupported feature (dropout, softcap, ALiBi, ...).
        ValueError: For inconsistent shapes, dtypes or offsets (also in the other kernels).
    """
    reject_unsupported(KERNELS, dropout_p, softcap, alibi_slopes, return_softmax=return_softmax)
    check_qkv(q, k, v, dims=4)
    left, right = resolve_window(causal, window_size_left, window_size_right)
    out, lse = attend_forward(q, k, v, resolve_scale(softmax_scale, q), left, right)
    return out.to(q.dtype), lse, *_unused_outputs(q)


def _flash_attn_varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    return_softmax: bool = False,
    block_table: Tensor | None = None,
    leftpad_k: Tensor | None = None,
    seqused_k: Tensor | None = None,
    zero_tensors: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Packed (varlen) attention forward (flash-attn 2.8 signature; see the module docstring).

    Args not listed here are as in :func:`_flash_attn_forward`; ``q`` is ``(total_q, nheads,
    headdim)`` and ``k``, ``v`` are ``(total_k, nheads_k, headdim)``.

    Args:
        cu_seqlens_q: int32 query offsets ``(num_seqs + 1,)``; masks are aligned per sequence.
        cu_seqlens_k: int32 key offsets ``(num_seqs + 1,)``.
        max_seqlen_q: Longest query sequence.
        max_seqlen_k: Longest key sequence.
        block_table: Must be ``None`` (no paged KV cache); so must ``leftpad_k``, ``seqused_k``.
        zero_tensors: Accepted; rows outside every sequence are always 0 here.

    Returns:
        ``(out, softmax_lse, S_dmask, rng_state)`` with fp32 ``softmax_lse`` ``(nheads, total_q)``.
    """
    reject_unsupported(
        KERNELS,
        dropout_p,
        softcap,
        alibi_slopes,
        return_softmax=return_softmax,
        block_table=block_table,
        leftpad_k=leftpad_k,
        seqused_k=seqused_k,
    )
    check_qkv(q, k, v, dims=3)
    scale = resolve_scale(softmax_scale, q)
    left, right = resolve_window(causal, window_size_left, window_size_right)
    out = torch.zeros_like(q)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    for rows_q, rows_k in _segments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k):
        seq_out, seq_lse = attend_forward(
            q[None, rows_q], k[None, rows_k], v[None, rows_k], scale, left, right
        )
        out[rows_q] = seq_out[0].to(q.dtype)
        lse[:, rows_q] = seq_lse[0]
    return out, lse, *_unused_outputs(q)


def _flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor | None,
    dk: Tensor | None,
    dv: Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    rng_state: Tensor | None = None,
) -> Tensor:
    """Dense attention backward (flash-attn 2.8 signature; see the module docstring).

    ``out`` and ``softmax_lse`` may belong to a larger attention (ring attention passes the
    merged ones): probabilities are recomputed as ``exp(scale * q k^T - softmax_lse)``, which is
    what makes the gradients of the blocks sum to the full gradient.

    Args:
        dout: Gradient of ``out``; ``q``, ``k``, ``v``, ``out`` as in the forward.
        softmax_lse: fp32 ``(batch, nheads, seqlen_q)``.
        dq: Overwritten in place (any strides) with the gradient of ``q``, and so are ``dk``
            and ``dv``; ``None`` skips one.
        dropout_p: ``softmax_scale`` to ``alibi_slopes`` as in the forward.
        deterministic: Ignored (this code is deterministic), as is ``rng_state``.

    Returns:
        ``softmax_d``: fp32 ``(batch, nheads, seqlen_q)``, the row sums of ``dout * out``.
    """
    reject_unsupported(KERNELS, dropout_p, softcap, alibi_slopes)
    check_qkv(q, k, v, dims=4, dout=dout, out=out)
    left, right = resolve_window(causal, window_size_left, window_size_right)
    *grads, softmax_d = attend_backward(
        dout, q, k, v, out, softmax_lse, resolve_scale(softmax_scale, q), left, right
    )
    write_gradients((dq, dk, dv), tuple(grads))
    return softmax_d


def _flash_attn_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor | None,
    dk: Tensor | None,
    dv: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    rng_state: Tensor | None = None,
    zero_tensors: bool = False,
) -> Tensor:
    """Packed (varlen) attention backward (flash-attn 2.8 signature; see the module docstring).

    Args not listed here are as in :func:`_flash_attn_backward` and
    :func:`_flash_attn_varlen_forward`; ``dq``, ``dk``, ``dv`` get the rows of each sequence.

    Args:
        softmax_lse: fp32 ``(nheads, total_q)``.
        zero_tensors: Zero ``dq``, ``dk``, ``dv`` first; otherwise rows outside every sequence
            are left untouched, as flash-attn leaves them.

    Returns:
        ``softmax_d``: fp32 ``(nheads, total_q)``, the row sums of ``dout * out``.
    """
    reject_unsupported(KERNELS, dropout_p, softcap, alibi_slopes)
    check_qkv(q, k, v, dims=3, dout=dout, out=out)
    scale = resolve_scale(softmax_scale, q)
    left, right = resolve_window(causal, window_size_left, window_size_right)
    for target in (dq, dk, dv):
        if zero_tensors and target is not None:
            target.zero_()
    softmax_d = q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)
    for rows_q, rows_k in _segments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k):
        *grads, seq_d = attend_backward(
            dout[None, rows_q],
            q[None, rows_q],
            k[None, rows_k],
            v[None, rows_k],
            out[None, rows_q],
            softmax_lse[None, :, rows_q],
            scale,
            left,
            right,
        )
        for target, rows, grad in zip((dq, dk, dv), (rows_q, rows_k, rows_k), grads, strict=True):
            if target is not None:
                target[rows].copy_(grad[0])
        softmax_d[:, rows_q] = seq_d[0]
    return softmax_d


def _segments(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, q: Tensor, k: Tensor
) -> list[tuple[slice, slice]]:
    """Validate varlen offsets and return the ``(q rows, k rows)`` of each sequence.

    flash-attn trusts wrong offsets and skips the tail of a sequence longer than
    ``max_seqlen_*`` without a word; checking here turns such bugs into errors on the CPU.
    """
    offsets = {}
    for name, cu, max_len, total in (
        ("q", cu_seqlens_q, max_seqlen_q, q.shape[0]),
        ("k", cu_seqlens_k, max_seqlen_k, k.shape[0]),
    ):
        if cu.dim() != 1 or cu.dtype != torch.int32 or cu.numel() < 1:
            raise ValueError(
                f"cu_seqlens_{name} must be a non-empty 1-D int32 tensor as flash-attn requires; "
                f"got {cu.dtype} {tuple(cu.shape)}."
            )
        offsets[name] = cu.tolist()
        lengths = [stop - start for start, stop in itertools.pairwise(offsets[name])]
        if offsets[name][0] < 0 or offsets[name][-1] > total or any(n < 0 for n in lengths):
            raise ValueError(
                f"cu_seqlens_{name} must be non-decreasing offsets into the {total} rows of {name}; "
                f"got {offsets[name]}."
            )
        if lengths and max(lengths) > int(max_len):
            raise ValueError(
                f"max_seqlen_{name}={int(max_len)} is shorter than a sequence of {max(lengths)} rows."
            )
    if len(offsets["q"]) != len(offsets["k"]):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe different numbers of sequences: {offsets}.")
    return [
        (slice(q0, q1), slice(k0, k1))
        for (q0, q1), (k0, k1) in zip(
            itertools.pairwise(offsets["q"]), itertools.pairwise(offsets["k"]), strict=True
        )
    ]


def _unused_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    # flash-attn returns an empty S_dmask without return_softmax, and the (seed, offset) of its
    # dropout RNG, which nothing reads without dropout.
    return q.new_empty((0,)), torch.zeros(2, dtype=torch.int64, device=q.device)
