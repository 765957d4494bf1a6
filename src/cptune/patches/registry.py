"""The one place that defines every set of patches cptune applies.

A training run's set is the patches every CP backend that shards its own inputs shares
(accelerate and the Trainer must not shard again), the DeepSpeed engine's patches for every
run on DeepSpeed's engine (a backend that ``runs_own_engine``, or one that ``runs_under_zero`` with
``deepspeed`` / ``zero_stage`` set), with the loader patch that gives a CP group one batch there,
then each backend's own patches
(:meth:`~cptune.parallel.backends.spec.BackendRuntime.training_patches`, defined next to the
backend in its package), in the order of the backend table; each patch's predicate decides whether a recipe needs it, so ``cptune validate``
can show what is applied and what is skipped. The patches that a recipe can need together
touch different targets, so their order does not change the result; it only fixes the order
of the log lines and of reverting. Two patches share ``AcceleratorState.__init__`` (CP without
FSDP on GPUs, FSDP2 on CPUs); their predicates exclude each other (``fsdp_version`` unset / set).
A backend's import-time set is its runtime's :meth:`~cptune.parallel.backends.spec.BackendRuntime.import_patches`.

The backends come in as data (:data:`cptune.parallel.backends.table.BACKENDS`, read through
:class:`PatchingBackend` and :class:`PatchingRuntime`): ``patches`` imports nothing of ``parallel``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from cptune.patches.accelerate_patches import (
    accelerator_state_cp_without_fsdp_patch,
    accelerator_state_fsdp_on_cpu_patch,
    cp_context_guard_patch,
    prepare_cp_patch,
    prepare_tp_passthrough_patch,
    validate_accelerator_multi_cpu_patch,
)
from cptune.patches.core import IMPORT_TIME_LOG, ContextParallelWith, Patch, PatchSet, SplitsTensors
from cptune.patches.deepspeed_patches import OnDeepSpeedEngine, deepspeed_engine_patches
from cptune.patches.peft_patches import lora_input_cast_patch
from cptune.patches.torch_patches import gloo_one_worker_patch
from cptune.patches.transformers_patches import trainer_cp_inputs_patch
from cptune.patches.zero_ring_patches import loader_shares_cp_batches_patch


class PatchingRuntime(Protocol):
    """What the registry reads of a backend's runtime (a part of :class:`cptune.parallel.backends.spec.BackendRuntime`)."""

    cp_context_guard: Callable[..., Any]

    def training_patches(self) -> Sequence[Patch]: ...

    def import_patches(self) -> Sequence[Patch]: ...


class PatchingBackend(Protocol):
    """What the registry reads of a CP backend (a part of :class:`cptune.parallel.backends.spec.BackendPolicy`)."""

    name: Any
    shards_inputs_itself: bool
    runs_own_engine: bool
    runs_under_zero: bool

    def runtime(self) -> PatchingRuntime: ...


def build_patches(
    chosen: PatchingBackend, backends: Iterable[PatchingBackend], local: PatchingBackend | None = None
) -> list[Patch]:
    """All patches of a training run, bound to the run's backend where a wrapper needs it.

    Args:
        chosen: The backend the recipe's ``cp_backend`` names (the run plan's ``cp_backend``): the
            wrappers of ``Accelerator._prepare_cp`` and of the CP context guard are its.
        backends: Every backend of the table, in its order.
        local: The backend of runs at ``context_parallel_size`` 1 (the table's ``LOCAL``), if they may train on
            DeepSpeed's engine (its ``runs_under_zero``).

    Plan and apply the resulting set with the recipe whose ``cp_backend`` names ``chosen``; the
    patches' predicates read that recipe.
    """
    backends = tuple(backends)
    self_sharding = ContextParallelWith(tuple(b.name for b in backends if b.shards_inputs_itself))
    # Every backend trains on accelerate's cp mesh axis: these accelerate patches let it exist without FSDP2.
    cp_mesh_without_fsdp = ContextParallelWith(tuple(b.name for b in backends if b.name), plain_ddp=True)
    under_zero = tuple(b.name for b in backends if b.runs_under_zero)
    on_deepspeed = OnDeepSpeedEngine(
        tuple(b.name for b in backends if b.runs_own_engine),
        under_zero,
        at_cp1=local is not None and local.runs_under_zero,
    )
    patches = [
        gloo_one_worker_patch(),  # before any process group exists: every gloo group the run makes
        trainer_cp_inputs_patch(self_sharding),
        prepare_cp_patch(self_sharding, shards_itself=chosen.shards_inputs_itself),
        cp_context_guard_patch(self_sharding, guard=chosen.runtime().cp_context_guard),
        validate_accelerator_multi_cpu_patch(cp_mesh_without_fsdp),
        accelerator_state_cp_without_fsdp_patch(cp_mesh_without_fsdp),
        accelerator_state_fsdp_on_cpu_patch(),
        prepare_tp_passthrough_patch(SplitsTensors()),
        *deepspeed_engine_patches(on_deepspeed),
        # a CP group's batch: nothing to share at cp=1
        loader_shares_cp_batches_patch(OnDeepSpeedEngine(on_deepspeed.always, on_deepspeed.under_zero)),
        lora_input_cast_patch(),
    ]
    for backend in backends:
        patches += backend.runtime().training_patches()
    return patches


def build_patch_set(
    chosen: PatchingBackend, backends: Iterable[PatchingBackend], local: PatchingBackend | None = None
) -> PatchSet:
    """The :class:`PatchSet` for a training run (:func:`build_patches`); ``RunPlan.patches`` is the one a run applies."""
    return PatchSet(build_patches(chosen, backends, local))


def import_patch_set(runtime: PatchingRuntime) -> PatchSet:
    """Patches needed only while a backend's library is imported; apply them around the import alone.

    Kept apart from :func:`build_patch_set` because the values are copied into the library's
    namespace at import time, so there is no reason to leave them in place for the whole run.
    Each patch's predicate (called with no recipe) says whether it is needed on this machine.
    """
    return PatchSet(runtime.import_patches(), log=logging.getLogger(IMPORT_TIME_LOG))
