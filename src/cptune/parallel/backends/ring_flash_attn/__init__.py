"""``cp_backend: ring-flash-attn``: ring attention with ring-flash-attn's functions (varlen_llama3 or zigzag).

:mod:`.keys` holds its recipe keys, :mod:`.policy` what validation and planning ask of it,
:mod:`.runtime` what a run needs, :mod:`.sharding` shards batches and calls the kernels,
:mod:`.kernel_choice` says which kernels run here, :mod:`.patches` makes its import work.
Imports no torch and no pydantic
(the GPU-side benchmarks import its sharding without them).
"""

NAME = "ring-flash-attn"

__all__ = ["NAME"]
