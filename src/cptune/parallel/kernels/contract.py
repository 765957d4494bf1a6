"""Argument checks shared by every implementation of flash-attn 2.8's four private kernels.

The CPU stand-ins (:mod:`~cptune.parallel.kernels.flash_attn_cpu`) and the adapter onto
PyTorch's FlashAttention-2 (:mod:`~cptune.parallel.kernels.torch_flash`) take the same
arguments and refuse the same features, so a misuse fails the same way in a CPU dry run as on
the GPU. Shape checks only: nothing here reads tensor values (no device synchronisation).
"""

from __future__ import annotations

from torch import Tensor


def reject_unsupported(
    kernels: str, dropout_p: float, softcap: float | None, alibi_slopes: Tensor | None, **options: object
) -> None:
    """Raise ``NotImplementedError`` naming every requested feature ``kernels`` lack.

    Args:
        kernels: Who refuses, for the message (e.g. "cptune's CPU stand-in for flash-attn").
        dropout_p: Must be 0; so must ``softcap``; ``alibi_slopes`` must be ``None``.
        options: Further features that must be falsy (``return_softmax``, ``block_table``, ...).
    """
    requested = {"dropout_p": dropout_p, "softcap": softcap, "alibi_slopes": alibi_slopes, **options}
    missing = [
        name if isinstance(value, Tensor) else f"{name}={value!r}"
        for name, value in requested.items()
        if isinstance(value, Tensor) or value
    ]
    if missing:
        raise NotImplementedError(
            f"{kernels} does not support {', '.join(missing)}: set attention dropout to 0, drop "
            "softcapping / ALiBi / paged KV, or run with flash-attn 2.8 on a CUDA machine."
        )


def check_qkv(q: Tensor, k: Tensor, v: Tensor, dims: int, **like_q: Tensor) -> None:
    """Check the layouts flash-attn expects (``like_q``: tensors shaped like ``q``)."""
    layout = "(batch, seqlen, nheads, headdim)" if dims == 4 else "(total, nheads, headdim)"
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != dims:
            raise ValueError(f"{name} must be {layout}; got shape {tuple(tensor.shape)}.")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}.")
    if not q.is_floating_point() or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}.")
    if q.shape[-1] != k.shape[-1] or (dims == 4 and q.shape[0] != k.shape[0]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch size and head dim.")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"nheads ({q.shape[-2]}) must be a multiple of nheads_k ({k.shape[-2]}).")
    for name, tensor in like_q.items():
        if tensor.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}; got {tuple(tensor.shape)}.")


def resolve_window(causal: bool, left: int | None, right: int | None) -> tuple[int, int]:
    """Normalize window bounds to ``-1`` (unbounded) or ``>= 0``; causal means ``right = 0``."""
    left = -1 if left is None or left < 0 else int(left)
    right = -1 if right is None or right < 0 else int(right)
    return left, 0 if causal else right


def resolve_scale(scale: float | None, q: Tensor) -> float:
    """flash-attn's default scale, ``headdim ** -0.5``, when ``scale`` is ``None``."""
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def write_gradients(targets: tuple[Tensor | None, ...], grads: tuple[Tensor, ...]) -> None:
    """Copy ``grads`` into flash-attn's in-place outputs (any strides); ``None`` skips one."""
    for target, grad in zip(targets, grads, strict=True):
        if target is not None:
            target.copy_(grad)
