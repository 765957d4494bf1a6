"""What a run with ``cp_backend: toy`` needs: its patch of :mod:`.upstream` (no sharder: it never trains)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends.spec import TrainerParallelism, accelerate_parallelism
from cptune.parallel.backends.toy import NAME
from cptune.patches.accelerate_patches import torch_cp_context_unavailable
from cptune.patches.core import ContextParallelWith, Patch

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.data.prepare import PreparedData
    from cptune.parallel.backends.spec import BackendPlan
    from cptune.parallel.layout import ParallelDims


def upstream_patch() -> Patch:
    return Patch(
        name="toy-upstream-describe",
        target="cptune.parallel.backends.toy.upstream:describe",
        replacement=lambda original: lambda: f"patched by {NAME}",
        reason="Shows that a backend's own patch is applied with the run's and reverted after it.",
        remove_when="never: it exists for the test of a new backend.",
        signature=(),
        applies_to=ContextParallelWith((NAME,)),
    )


class ToyRuntime:
    library = None
    cp_context_guard = staticmethod(torch_cp_context_unavailable)

    def check_ready(self, recipe: Recipe, *, training: bool) -> None:
        return None

    def check_prepared_rows(self, recipe: Recipe, prepared: PreparedData) -> None:
        return None

    def trainer_parallelism(self, recipe: Recipe, dims: ParallelDims) -> TrainerParallelism:
        return accelerate_parallelism(dims)

    def plan(self, recipe: Recipe, dims: ParallelDims, pad_token_id: int, model_config: Any) -> BackendPlan:
        raise NotImplementedError("the toy backend is never trained with")

    def training_patches(self) -> Sequence[Patch]:
        return (upstream_patch(),)

    def import_patches(self) -> Sequence[Patch]:
        return ()


RUNTIME = ToyRuntime()
