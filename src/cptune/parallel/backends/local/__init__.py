"""``context_parallel_size: 1``: every rank attends over whole rows (whatever ``cp_backend`` says).

This module is the backend as the rest of cptune sees it (:class:`Local`, see
:mod:`cptune.parallel.backends.spec`); :mod:`.sharding` gives the model whole rows (with
cptune's document-aware attention for ``causal: false``). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends.spec import (
    BackendPlan,
    CpBackendName,
    TrainerParallelism,
    accelerate_parallelism,
)

if TYPE_CHECKING:
    from cptune.patches.core import Patch


class Local:
    """No context parallelism: transformers' attention (causal) or cptune's bidirectional attention."""

    name: CpBackendName | None = None
    label = "cptune's bidirectional attention"
    shards_inputs_itself = True
    drives_torch_cp = False
    runs_own_engine = False
    runs_under_zero = False
    attends_whole_layers = True
    splits_heads = False

    def recipe_rules(self, recipe: Any) -> Iterator[tuple[str, str]]:
        """No context parallelism: no rules of its own (the chosen cp_backend's keys are checked by it)."""
        return iter(())

    def chunks_per_rank(self, recipe: Any) -> int:
        return 1

    def check_ready(self, recipe: Any, *, training: bool) -> None:
        return None

    def check_model(self, recipe: Any, cp_size: int, text_config: Any) -> None:
        return None  # the common checks (select.check_model_config) are all it needs

    def uses_cptune_attention(self, recipe: Any) -> bool:
        return not recipe.causal

    def sequence_split(self, recipe: Any) -> str:
        return "contiguous"

    def check_prepared_rows(self, recipe: Any, prepared: Any) -> None:
        return None

    def plan_lines(self, recipe: Any) -> list[str]:
        return [f"attention:  single rank, {'causal' if recipe.causal else 'bidirectional'}"]

    def trainer_parallelism(self, recipe: Any, dims: Any) -> TrainerParallelism:
        return accelerate_parallelism(dims)  # FSDP2 without CP still needs accelerate's mesh

    def plan(self, recipe: Any, dims: Any, pad_token_id: int) -> BackendPlan:
        from cptune.parallel.backends.local.sharding import LocalBackend

        local = LocalBackend(causal=recipe.causal)
        return BackendPlan(local.attn_implementation, lambda accelerator, model: local)

    def training_patches(self) -> Sequence[Patch]:
        return ()

    def import_patches(self) -> Sequence[Patch]:
        return ()

    def attention_buffer_bytes(self, shape: Any, setup: Any) -> float:
        return 0.0

    def zero_stage(self, recipe: Any) -> int | None:
        return None


LOCAL = Local()
