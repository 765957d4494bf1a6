"""What a run at context_parallel_size 1 needs (:class:`LocalRuntime`): the whole-row sharder, accelerate's mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cptune.parallel.backends.spec import BackendPlan, TrainerParallelism, accelerate_parallelism
from cptune.patches.accelerate_patches import torch_cp_context_unavailable

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.data.prepare import PreparedData
    from cptune.parallel.layout import ParallelDims
    from cptune.patches.core import Patch


class LocalRuntime:
    """Whole rows on every rank, next to plain DDP or FSDP2."""

    library = None
    cp_context_guard = staticmethod(torch_cp_context_unavailable)

    def check_ready(self, recipe: Recipe, *, training: bool) -> None:
        return None

    def check_prepared_rows(self, recipe: Recipe, prepared: PreparedData) -> None:
        return None

    def trainer_parallelism(self, recipe: Recipe, dims: ParallelDims) -> TrainerParallelism:
        return accelerate_parallelism(dims)  # FSDP2 without CP still needs accelerate's mesh

    def plan(self, recipe: Recipe, dims: ParallelDims, pad_token_id: int) -> BackendPlan:
        from cptune.parallel.backends.local.sharding import LocalBackend

        local = LocalBackend(causal=recipe.causal)
        return BackendPlan(local.attn_implementation, lambda accelerator, model: local)

    def training_patches(self) -> Sequence[Patch]:
        return ()

    def import_patches(self) -> Sequence[Patch]:
        return ()


RUNTIME = LocalRuntime()
