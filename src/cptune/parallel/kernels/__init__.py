"""flash-attn's private kernels without flash-attn, so ring-flash-attn runs anywhere.

:mod:`~cptune.parallel.kernels.torch_flash` adapts PyTorch's own FlashAttention-2 (CUDA,
bf16/fp16), :mod:`~cptune.parallel.kernels.flash_attn_cpu` holds pure-PyTorch stand-ins (any
device and dtype), :mod:`~cptune.parallel.kernels.dispatch` picks one of them per call and
:mod:`~cptune.parallel.kernels.shim` makes ring-flash-attn import the dispatching functions when
flash-attn is absent. Importing this package imports neither torch nor any upstream library.
"""

from cptune.parallel.kernels.shim import (
    KERNEL_NAMES,
    flash_attn_available,
    flash_attn_shim_patches,
    shim_modules,
)

__all__ = ["KERNEL_NAMES", "flash_attn_available", "flash_attn_shim_patches", "shim_modules"]
