"""``cp_backend: deepspeed``: DeepSpeed's Ulysses (all-to-all over heads) under DeepSpeed's ZeRO engine.

:mod:`.keys` holds its recipe keys (with DeepSpeed's ZeRO keys), :mod:`.policy` what validation
and planning ask of it, :mod:`.runtime` what a run needs, :mod:`.sharding` builds DeepSpeed's
config, loads it and gives each rank its model inputs, :mod:`.patches` lets Ulysses wrap cptune's
attention for the run only. Imports no torch and no pydantic
(the GPU-side benchmarks import its sharding without them).
"""

NAME = "deepspeed"

__all__ = ["NAME"]
