"""flash-attn 2.8's four private kernels on PyTorch's own FlashAttention-2 (CUDA, bf16/fp16).

Without the flash-attn package, ring-flash-attn would run the pure-PyTorch stand-ins on a GPU,
about 100x slower than fused attention. torch ships FlashAttention-2 itself, with variable-length
sequences and the log-sum-exp, as two ATen ops that this module adapts to flash-attn's calling
conventions (:mod:`cptune.parallel.kernels.flash_attn_cpu` states them):

* ``aten::_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
  dropout_p, is_causal, return_debug_mask, *, scale, window_size_left, window_size_right, ...)
  -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask)`` and
  ``aten::_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q,
  cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale,
  window_size_left, window_size_right) -> (dq, dk, dv)``. These are the registered schemas of
  torch 2.11.0, 2.13.0 and 2.14.1 alike (read from each wheel's libtorch_cpu.so); 2.13 adds
  ``block_table`` and ``num_splits`` after them, unused here. :func:`missing_schema_arguments`
  checks them at run time. ``torch.nn.attention.varlen.varlen_attn`` is not used: it has its own
  autograd, so its backward cannot take the merged output and LSE of a ring step, and its
  ``enable_gqa`` argument exists in 2.13 but not in 2.11.
* Layouts are flash-attn's: dense ``(b, s, h, d)`` with LSE ``(b, h, s)``; varlen ``(total, h, d)``
  with LSE ``(h, total_q)``, which ``mha_varlen_fwd`` allocates (``{num_heads, total_q}``,
  ``unpadded_lse=true`` in torch's flash_attn/flash_api.cpp) and torch's meta registrations of
  2.11, 2.13 and 2.14 state for CUDA (ROCm's differs, so ROCm is not used here).
* Masks are bottom-right aligned per sequence, as in flash-attn 2.8: torch's vendored
  flash_attn/mask.h lets query row ``i`` of a sequence see keys below
  ``i + 1 + seqlen_k - seqlen_q + window_size_right``. ring-flash-attn's ``varlen_llama3`` path
  (queries of a shard against all earlier keys of their document) relies on exactly this.
* Grouped-query attention is native (``num_heads % num_heads_k == 0``; the backward sums dK and
  dV over each group).

Differences from flash-attn, all deliberate:

* Rows that see no key get ``lse = -inf``, not the kernel's ``+inf``, as with the stand-ins (see
  there: ``+inf`` would make ring-flash-attn's merge drop the other blocks). The backward takes
  either: FlashAttention's ``scale_apply_exp2`` treats a ``-inf`` row maximum as 0.
* The backward writes ``dq``, ``dk``, ``dv`` by copying the op's fresh gradients into the views
  it is given, and returns ``None`` instead of ``softmax_d``: the op does not return it, and
  ring-flash-attn 0.1.8 never reads it (llama3_flash_attn_varlen.py, zigzag_ring_flash_attn.py).
* dropout, softcapping, ALiBi, ``return_softmax``, paged KV and ``zero_tensors`` raise
  ``NotImplementedError``; ``deterministic`` follows ``torch.use_deterministic_algorithms``.

These functions run only where :func:`runs` holds; :mod:`cptune.parallel.kernels.dispatch`
sends every other call to the stand-ins.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cptune.parallel.kernels.contract import (
    check_qkv,
    reject_unsupported,
    resolve_scale,
    resolve_window,
    write_gradients,
)

KERNELS = "PyTorch's FlashAttention-2 kernels (aten._flash_attention_forward/backward)"
HALF_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256

# The arguments this adapter passes: the positional ones by position, the rest by name.
_FORWARD_POSITIONAL = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k")
_FORWARD_POSITIONAL += ("dropout_p", "is_causal", "return_debug_mask")
_BACKWARD_POSITIONAL = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q")
_BACKWARD_POSITIONAL += ("cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal")
_KEYWORDS = ("scale", "window_size_left", "window_size_right")


@dataclass(frozen=True)
class FlashOps:
    """The two ops, with ``torch.ops.aten``'s calling convention."""

    forward: Callable[..., tuple[Tensor, ...]]
    backward: Callable[..., tuple[Tensor, ...]]


def flash_ops() -> FlashOps:
    """torch's flash-attention ops (the CPU tests substitute a float64 reference with their contract)."""
    return FlashOps(
        torch.ops.aten._flash_attention_forward.default, torch.ops.aten._flash_attention_backward.default
    )


def missing_schema_arguments(ops: tuple[object, object] | None = None) -> list[str]:
    """Arguments this adapter passes that the installed torch's op schemas lack (``[]``: all there).

    Args:
        ops: ``(forward, backward)`` op overloads to inspect; torch's by default.
    """
    if ops is None:
        ops = (
            torch.ops.aten._flash_attention_forward.default,
            torch.ops.aten._flash_attention_backward.default,
        )
    missing = []
    for op, positional in zip(ops, (_FORWARD_POSITIONAL, _BACKWARD_POSITIONAL), strict=True):
        arguments = op._schema.arguments
        leading = tuple(a.name for a in arguments if not a.kwarg_only)[: len(positional)]
        name = op._schema.name
        if leading != positional:
            missing.append(f"{name}({', '.join(positional)}, ...) (has {', '.join(leading)})")
        names = {a.name for a in arguments}
        missing += [f"{name}(..., {keyword}=)" for keyword in _KEYWORDS if keyword not in names]
    return missing


@functools.cache
def unavailable_reason() -> str | None:
    """Why torch's flash kernels cannot run here, or ``None`` when they can (on CUDA, bf16/fp16)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if not torch.backends.cuda.is_flash_attention_available():
        return f"torch {torch.__version__} was built without FlashAttention"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"FlashAttention-2 needs a GPU of compute capability 8.0 or newer; this one is {major}.{minor}"
    missing = missing_schema_arguments()
    if missing:
        return f"torch {torch.__version__}'s flash-attention ops lack {'; '.join(missing)}"
    return None


def runs(q: Tensor) -> bool:
    """Whether these kernels take ``q`` (and its ``k``, ``v``): CUDA, bf16/fp16, head dim a multiple of 8."""
    head_dim = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in HALF_DTYPES
        and head_dim % 8 == 0
        and head_dim <= MAX_HEAD_DIM
        and unavailable_reason() is None
    )


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
    """Dense forward: ``(out, softmax_lse (b, h, s_q) fp32, empty S_dmask, rng_state)``."""
    reject_unsupported(KERNELS, dropout_p, softcap, alibi_slopes, return_softmax=return_softmax)
    check_qkv(q, k, v, dims=4)
    left, right = resolve_window(causal, window_size_left, window_size_right)
    out, lse, rng_state, _, _ = flash_ops().forward(
        *_last_dim_contiguous(q, k, v),
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        False,
        scale=resolve_scale(softmax_scale, q),
        window_size_left=left,
        window_size_right=right,
    )
    _check_lse(lse, (q.shape[0], q.shape[2], q.shape[1]), "(batch, nheads, seqlen_q)")
    return out, _no_key_rows_to_minus_inf(lse), q.new_empty((0,)), rng_state


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
    """Varlen forward: ``(out, softmax_lse (h, total_q) fp32, empty S_dmask, rng_state)``."""
    reject_unsupported(
        KERNELS,
        dropout_p,
        softcap,
        alibi_slopes,
        return_softmax=return_softmax,
        block_table=block_table,
        leftpad_k=leftpad_k,
        seqused_k=seqused_k,
        zero_tensors=zero_tensors,
    )
    check_qkv(q, k, v, dims=3)
    left, right = resolve_window(causal, window_size_left, window_size_right)
    out, lse, rng_state, _, _ = flash_ops().forward(
        *_last_dim_contiguous(q, k, v),
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        0.0,
        causal,
        False,
        scale=resolve_scale(softmax_scale, q),
        window_size_left=left,
        window_size_right=right,
    )
    _check_lse(lse, (q.shape[1], q.shape[0]), "(nheads, total_q)")
    return out, _no_key_rows_to_minus_inf(lse), q.new_empty((0,)), rng_state


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
) -> None:
    """Dense backward into ``dq``, ``dk``, ``dv``; ``out``/``softmax_lse`` may be a ring's merged ones."""
    reject_unsupported(KERNELS, dropout_p, softcap, alibi_slopes)
    check_qkv(q, k, v, dims=4, dout=dout, out=out)
    _backward(dout, q, k, v, out, softmax_lse, (dq, dk, dv), None, None, q.shape[1], k.shape[1],
              softmax_scale, causal, window_size_left, window_size_right)  # fmt: skip


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
) -> None:
    """Varlen backward into ``dq``, ``dk``, ``dv`` (rows of every sequence; others stay as they are)."""
    reject_unsupported(KERNELS, dropout_p, softcap, alibi_slopes, zero_tensors=zero_tensors)
    check_qkv(q, k, v, dims=3, dout=dout, out=out)
    _backward(dout, q, k, v, out, softmax_lse, (dq, dk, dv), cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
              int(max_seqlen_k), softmax_scale, causal, window_size_left, window_size_right)  # fmt: skip


def _backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    targets: tuple[Tensor | None, Tensor | None, Tensor | None],
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    causal: bool,
    window_size_left: int | None,
    window_size_right: int | None,
) -> None:
    left, right = resolve_window(causal, window_size_left, window_size_right)
    # Without dropout the kernel reads neither RNG tensor; the op still takes two.
    unused = torch.empty((0,), dtype=torch.uint64, device=q.device)
    grads = flash_ops().backward(
        dout,
        *_last_dim_contiguous(q, k, v, out),
        # The kernel reads the LSE through a raw pointer in its documented layout.
        lse.contiguous(),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        0.0,
        causal,
        unused,
        unused,
        scale=resolve_scale(softmax_scale, q),
        window_size_left=left,
        window_size_right=right,
    )
    write_gradients(targets, tuple(grads))


def _last_dim_contiguous(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The kernels take any row and head strides but need unit stride in the head dim."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _check_lse(lse: Tensor, shape: tuple[int, ...], layout: str) -> None:
    if tuple(lse.shape) != shape or lse.dtype != torch.float32:
        raise RuntimeError(
            f"torch {torch.__version__}'s flash-attention op returned a log-sum-exp of shape "
            f"{tuple(lse.shape)} ({lse.dtype}); cptune expects fp32 {layout} = {shape}, the layout of "
            "torch 2.11 to 2.14 on CUDA. Please report this with your torch version."
        )


def _no_key_rows_to_minus_inf(lse: Tensor) -> Tensor:
    """FlashAttention writes ``+inf`` for rows without visible keys; flash-attn's merge needs ``-inf``."""
    return lse.masked_fill_(lse == float("inf"), float("-inf"))
