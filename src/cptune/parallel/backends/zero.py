"""DeepSpeed's ZeRO engine under cptune's own sharding (``deepspeed`` / ``zero_stage`` with ring-flash-attn or torch CP,
or at context_parallel_size 1 with whole rows on every rank).

A backend with ``runs_under_zero`` (see :class:`~cptune.parallel.backends.spec.BackendPolicy`) shards each
batch over its CP group as it does next to DDP, while DeepSpeed's engine trains the model (ZeRO 0-3
over all ranks, no sequence-parallel group) when the recipe sets ``deepspeed`` or ``zero_stage``.
``cp_backend: deepspeed`` (Ulysses) trains the same way, always on DeepSpeed's engine.
Two things differ from DDP:

* the batches: under DeepSpeed accelerate 1.15's data loader ignores the mesh's ``cp`` axis, so every
  rank would get a batch of its own; the patch registry adds
  :func:`cptune.patches.zero_ring_patches.loader_shares_cp_batches_patch` for every run on DeepSpeed's engine.
* the gradient: without a sequence-parallel group DeepSpeed averages gradients over all ranks (ZeRO 0:
  engine.py ``allreduce_gradients``; 1/2: stage_1_and_2.py; 3: reduce-scatter over the world), DDP's
  divisor; cptune's loss scaling needs nothing else.

The engine-level DeepSpeed patches (CPU world size, no shared-memory op build, the ZeRO-0 gradient
norm) apply to every run on DeepSpeed's engine, and :mod:`cptune.run.training.deepspeed_state` puts DeepSpeed's
process-wide state back after it. Imports no torch (the recipe's validation reads it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cptune.parallel.backends.spec import TrainerParallelism, accelerate_parallelism

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.spec import BackendPolicy
    from cptune.parallel.layout import ParallelDims


def asks_for_zero(recipe: Recipe) -> bool:
    """The recipe sets ``deepspeed`` or ``zero_stage`` (DeepSpeed's engine trains it, at any cp size)."""
    return recipe.deepspeed is not None or recipe.zero_stage is not None


def trains_on_deepspeed(backend: BackendPolicy, recipe: Recipe) -> bool:
    """DeepSpeed's engine trains the recipe with ``backend`` (its own engine, or ZeRO under cptune's sharding)."""
    return backend.runs_own_engine or (backend.runs_under_zero and asks_for_zero(recipe))


def deepspeed_stage(recipe: Recipe) -> int:
    """The ZeRO stage DeepSpeed's engine runs (``zero_stage``, or the ``deepspeed`` JSON's; reads and checks it)."""
    from cptune.parallel.backends.deepspeed_ulysses.sharding import deepspeed_config

    return int(deepspeed_config(recipe)["zero_optimization"]["stage"])


def check_engine_ready(recipe: Recipe) -> None:
    """DeepSpeed is installed, and its config (``zero_stage`` / the ``deepspeed`` JSON) fits the recipe."""
    from cptune.parallel.backends.deepspeed_ulysses.sharding import load_deepspeed

    load_deepspeed()
    deepspeed_stage(recipe)  # reads and checks the JSON


def check_ready_under_zero(recipe: Recipe) -> None:
    """:func:`check_engine_ready` when the recipe asks for ZeRO (a ring or torch backend's ``check_ready``)."""
    if asks_for_zero(recipe):
        check_engine_ready(recipe)


def parallelism_under_zero(recipe: Recipe, dims: ParallelDims) -> TrainerParallelism:
    """accelerate's DDP-style mesh (cp axis), with DeepSpeed's config when the recipe asks for ZeRO."""
    ddp = accelerate_parallelism(dims)
    if not asks_for_zero(recipe):
        return ddp
    from cptune.parallel.backends.deepspeed_ulysses.sharding import deepspeed_config

    return TrainerParallelism(ddp.parallelism, deepspeed_config(recipe))


def stage_under_zero(recipe: Recipe) -> int | None:
    """The ZeRO stage when the recipe asks for ZeRO, else None (DDP or FSDP2 holds the model states)."""
    return deepspeed_stage(recipe) if asks_for_zero(recipe) else None
