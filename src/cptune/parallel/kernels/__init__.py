"""Pure-torch stand-ins for flash-attn's kernels, so ring-flash-attn runs on CPU.

:mod:`cptune.parallel.kernels.flash_attn_cpu` holds the kernels and
:mod:`cptune.parallel.kernels.shim` makes ring-flash-attn import them when flash-attn
is absent. Importing this package imports neither torch nor any upstream library.
"""

from cptune.parallel.kernels.shim import (
    KERNEL_NAMES,
    flash_attn_available,
    flash_attn_shim_patches,
    shim_modules,
)

__all__ = ["KERNEL_NAMES", "flash_attn_available", "flash_attn_shim_patches", "shim_modules"]
