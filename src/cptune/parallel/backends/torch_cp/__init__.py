"""``cp_backend: torch``: torch's native context-parallel ring attention (DTensor SDPA dispatch).

:mod:`.keys` holds its recipe keys, :mod:`.policy` what validation and planning ask of it,
:mod:`.runtime` what a run needs, :mod:`.sharding` shards batches and drives torch's dispatch
around each step, :mod:`.patches` gives torch's ring attention its CPU handlers. Imports no torch and no pydantic
(the GPU-side benchmarks import its sharding without them).
"""

NAME = "torch"

__all__ = ["NAME"]
