"""Which kernels compute ring-flash-attn's blocks on this machine, and whether the precision suits them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cptune.errors import CptuneError

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe


def uses_half_precision(recipe: Recipe) -> bool:
    """Whether the model computes in bf16/fp16 (``bf16: auto`` is bf16 on the GPUs cptune targets)."""
    return recipe.bf16 in (True, "auto") or bool(recipe.fp16)


def check_ring_precision(recipe: Recipe, *, cuda: bool, flash_attn: bool) -> None:
    """flash-attn's CUDA kernels take half precision only; the CPU stand-ins take any float.

    Called before launching (preflight) and again where the backend is built. Without flash-attn
    an fp32 run on a GPU falls back to the stand-ins, and :func:`slow_ring_kernels_warning` says so.
    """
    if cuda and flash_attn and not uses_half_precision(recipe):
        raise CptuneError(
            "cp_backend: ring-flash-attn runs flash-attn's CUDA kernels, which support bf16 and fp16 "
            "only; set bf16: true (or fp16: true)."
        )


@dataclass(frozen=True)
class RingKernelChoice:
    """Which kernels compute ring-flash-attn's blocks, and why (for ``cptune validate`` and the log)."""

    name: str
    slow_warning: str | None = None


def ring_kernel_choice(
    *, cuda: bool, flash_attn: bool, half: bool, torch_flash_missing: str | None = None
) -> RingKernelChoice:
    """The kernels ring-flash-attn will run (:mod:`cptune.parallel.kernels.dispatch` decides the same per call).

    Args:
        cuda: A CUDA device is present.
        flash_attn: The flash-attn package is installed.
        half: The model computes in bf16/fp16.
        torch_flash_missing: Why PyTorch's FlashAttention-2 cannot run here
            (``torch_flash.unavailable_reason()``), ``None`` when it can.
    """
    if flash_attn:
        return RingKernelChoice("flash-attn")
    if cuda and half and torch_flash_missing is None:
        return RingKernelChoice(
            "PyTorch's FlashAttention-2 (aten._flash_attention_forward/backward; flash-attn not installed)"
        )
    if not cuda:
        return RingKernelChoice("cptune's pure-PyTorch stand-ins (flash-attn not installed)")
    why = (
        "fp32, and PyTorch's FlashAttention-2 takes bf16/fp16 only"
        if not half
        else f"PyTorch's FlashAttention-2 cannot run here: {torch_flash_missing}"
    )
    # Measured on one H100 (bf16, causal, 32 query / 8 KV heads of 128, forward and backward of one
    # 16384-token sequence): the stand-ins 1500 ms, PyTorch's flash SDPA 13.9 ms, and twice the memory.
    fix = "set bf16: true" if not half else "install flash-attn (pip install -e '.[flash-attn]')"
    warning = (
        f"ring-flash-attn computes attention with cptune's pure-PyTorch stand-in kernels ({why}); they "
        "are exact but about 100x slower than flash attention on a GPU (measured on an H100 at 16K "
        f"tokens) and use twice its memory. To run fused kernels, {fix}, or use cp_backend: torch."
    )
    return RingKernelChoice(f"cptune's pure-PyTorch stand-ins ({why})", warning)


def describe_ring_kernels(recipe: Recipe, *, cuda: bool, flash_attn: bool) -> RingKernelChoice:
    """:func:`ring_kernel_choice` for this recipe on this machine."""
    from cptune.parallel.kernels import torch_flash

    return ring_kernel_choice(
        cuda=cuda,
        flash_attn=flash_attn,
        half=uses_half_precision(recipe),
        torch_flash_missing=torch_flash.unavailable_reason() if cuda else None,
    )
