"""The four kernels ring-flash-attn imports when flash-attn is absent, chosen per call.

A call whose ``q`` PyTorch's FlashAttention-2 takes (CUDA, bf16/fp16, see
:func:`cptune.parallel.kernels.torch_flash.runs`) runs there; every other call (CPU tensors,
fp32 on a GPU) runs cptune's pure-PyTorch stand-ins. Deciding per call, not at import, keeps
the answer right in a process that imported ring-flash-attn once and then holds tensors of
another device or dtype.

Each function has exactly the signature of its flash-attn 2.8 counterpart (through
``__signature__``): ring-flash-attn builds its keyword arguments from
``inspect.getfullargspec`` of the function it imported (ring_flash_attn/utils.py,
``get_default_args``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from cptune.parallel.kernels import flash_attn_cpu, torch_flash


def implementation(name: str, q: Any) -> Callable[..., Any]:
    """The implementation of kernel ``name`` that runs for query ``q``."""
    return getattr(torch_flash if torch_flash.runs(q) else flash_attn_cpu, name)


def _dispatching(name: str) -> Callable[..., Any]:
    signature = inspect.signature(getattr(flash_attn_cpu, name))

    def kernel(*args: Any, **kwargs: Any) -> Any:
        q = signature.bind(*args, **kwargs).arguments["q"]
        return implementation(name, q)(*args, **kwargs)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__signature__ = signature  # type: ignore[attr-defined]
    kernel.__doc__ = (
        f"flash-attn 2.8's ``{name}``: PyTorch's flash kernels where they run, else the stand-ins."
    )
    return kernel


_flash_attn_forward = _dispatching("_flash_attn_forward")
_flash_attn_backward = _dispatching("_flash_attn_backward")
_flash_attn_varlen_forward = _dispatching("_flash_attn_varlen_forward")
_flash_attn_varlen_backward = _dispatching("_flash_attn_varlen_backward")
