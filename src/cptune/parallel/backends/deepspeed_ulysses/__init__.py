"""``cp_backend: deepspeed``: DeepSpeed's Ulysses (all-to-all over heads) under DeepSpeed's ZeRO engine.

:mod:`.keys` holds its recipe keys (with DeepSpeed's ZeRO keys), :mod:`.policy` what validation
and planning ask of it, :mod:`.runtime` what a run needs, :mod:`.sharding` builds DeepSpeed's
config, puts DeepSpeed's Ulysses attention in place and gives each rank its slice of every batch,
:mod:`.patches` keeps that attention to the run. Imports no torch and no pydantic
(the GPU-side benchmarks import its sharding without them).
"""

NAME = "deepspeed"

__all__ = ["NAME"]
