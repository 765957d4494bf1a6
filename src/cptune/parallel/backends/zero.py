"""DeepSpeed's ZeRO engine under cptune's own sharding (``deepspeed`` / ``zero_stage`` with ring-flash-attn or torch CP).

A backend with ``runs_under_zero`` (see :class:`~cptune.parallel.backends.spec.CpBackend`) shards each
batch over its CP group as it does next to DDP, while DeepSpeed's engine trains the model (ZeRO 0-3
over all ranks, no sequence-parallel group) when the recipe sets ``deepspeed`` or ``zero_stage``.
Two things differ from DDP:

* the batches: under DeepSpeed accelerate 1.15's data loader ignores the mesh's ``cp`` axis, so every
  rank would get a batch of its own; the patch registry adds
  :func:`cptune.patches.deepspeed_patches.loader_shares_cp_batches_patch` for these backends.
* the gradient: without a sequence-parallel group DeepSpeed averages gradients over all ranks (ZeRO 0:
  engine.py ``allreduce_gradients``; 1/2: stage_1_and_2.py; 3: reduce-scatter over the world), DDP's
  divisor; cptune's loss scaling needs nothing else.

The engine-level DeepSpeed patches (CPU world size, no shared-memory op build) apply to every run on
DeepSpeed's engine. Imports no torch (the recipe's validation reads :func:`zero3_memory_problems`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cptune.errors import CptuneError
from cptune.parallel.backends.spec import TrainerParallelism, accelerate_parallelism


def asks_for_zero(recipe: Any) -> bool:
    """The recipe sets ``deepspeed`` or ``zero_stage`` (DeepSpeed's engine trains it at cp > 1)."""
    return recipe.deepspeed is not None or recipe.zero_stage is not None


def trains_on_deepspeed(backend: Any, recipe: Any) -> bool:
    """DeepSpeed's engine trains the recipe with ``backend`` (its own engine, or ZeRO under cptune's sharding)."""
    return backend.runs_own_engine or (backend.runs_under_zero and asks_for_zero(recipe))


def deepspeed_stage(recipe: Any) -> int:
    """The ZeRO stage DeepSpeed's engine runs (``zero_stage``, or the ``deepspeed`` JSON's; reads and checks it)."""
    from cptune.parallel.backends.deepspeed_ulysses.sharding import deepspeed_config

    return int(deepspeed_config(recipe)["zero_optimization"]["stage"])


def zero3_memory_problems(r: Any) -> Iterator[tuple[str, str]]:
    """The memory features that DeepSpeed ZeRO-3 cannot serve yet (also checked for a `deepspeed` JSON's stage)."""
    for key, on in (("tiled_mlp", r.tiled_mlp), ("cut_cross_entropy", r.resolved_head_loss)):
        if on:
            yield (
                key,
                "is not supported with DeepSpeed ZeRO-3 yet: it calls modules again in the backward pass, after "
                "ZeRO-3 released their gathered weights. Use zero_stage 0-2, or remove it "
                "(activation_offloading works with ZeRO-3).",
            )


def zero3_json_problems(recipe: Any, stage: int) -> list[str]:
    """Memory features a ZeRO-3 ``stage`` cannot serve, as messages (the recipe rules see ``zero_stage`` only)."""
    if stage != 3:
        return []
    return [
        f"{key}: the DeepSpeed JSON {recipe.deepspeed} sets ZeRO stage 3, which frees each module's "
        f"gathered weights after its forward pass, but {key} calls modules again in the backward pass "
        "(not supported yet). Use a ZeRO stage below 3, or remove it."
        for key, _ in zero3_memory_problems(recipe)
    ]


def check_engine_ready(recipe: Any) -> None:
    """DeepSpeed is installed, and its config (``zero_stage`` / the ``deepspeed`` JSON) fits the recipe."""
    from cptune.parallel.backends.deepspeed_ulysses.sharding import load_deepspeed

    load_deepspeed()
    for problem in zero3_json_problems(recipe, deepspeed_stage(recipe)):  # reads and checks the JSON
        raise CptuneError(problem)


def check_ready_under_zero(recipe: Any) -> None:
    """:func:`check_engine_ready` when the recipe asks for ZeRO (a ring or torch backend's ``check_ready``)."""
    if asks_for_zero(recipe):
        check_engine_ready(recipe)


def parallelism_under_zero(recipe: Any, dims: Any) -> TrainerParallelism:
    """accelerate's DDP-style mesh (cp axis), with DeepSpeed's config when the recipe asks for ZeRO."""
    ddp = accelerate_parallelism(dims)
    if not asks_for_zero(recipe):
        return ddp
    from cptune.parallel.backends.deepspeed_ulysses.sharding import deepspeed_config

    return TrainerParallelism(ddp.parallelism, deepspeed_config(recipe))


def stage_under_zero(recipe: Any) -> int | None:
    """The ZeRO stage when the recipe asks for ZeRO, else None (DDP or FSDP2 holds the model states)."""
    return deepspeed_stage(recipe) if asks_for_zero(recipe) else None
