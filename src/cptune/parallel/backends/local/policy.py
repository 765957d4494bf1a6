"""What validation and planning ask of the local backend (:class:`Local`, context_parallel_size 1). Imports no torch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends import zero

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.spec import BackendRuntime, SequenceSplit
    from cptune.parallel.memory import ModelShape


class Local:
    """No context parallelism: cptune's attention, document by document (transformers' sdpa and its
    tokens x tokens mask for a causal model it cannot serve: :func:`.runtime.attends_by_document`)."""

    name: str | None = None
    label = "cptune's bidirectional attention"
    variant_key = None
    shards_inputs_itself = True
    runs_own_engine = False
    runs_under_zero = True  # deepspeed / zero_stage at cp=1: DeepSpeed's ZeRO next to plain data parallelism
    attends_whole_layers = True
    splits_heads = False
    takes_tensor_parallel = True
    trains_preference_pairs = True

    def run_name(self, recipe: Recipe) -> str:
        return self.label if self.name is None else self.name

    def recipe_rules(self, recipe: Recipe) -> Iterator[tuple[str, str]]:
        """No context parallelism: no rules of its own (the chosen cp_backend's keys are checked by it)."""
        return iter(())

    def chunks_per_rank(self, recipe: Recipe) -> int:
        return 1

    def check_model(self, recipe: Recipe, cp_size: int, text_config: Any) -> None:
        return None  # the common checks (select.check_model_config) are all it needs

    def uses_cptune_attention(self, recipe: Recipe) -> bool:
        return not recipe.causal

    def sequence_split(self, recipe: Recipe) -> SequenceSplit:
        return "contiguous"

    def plan_lines(self, recipe: Recipe) -> list[str]:
        return [f"attention:  single rank, {'causal' if recipe.causal else 'bidirectional'}"]

    def attention_buffer_bytes(
        self, recipe: Recipe, shape: ModelShape, cp_size: int, dtype_bytes: int
    ) -> float:
        return 0.0

    def zero_stage(self, recipe: Recipe) -> int | None:
        return zero.stage_under_zero(recipe)

    def runtime(self) -> BackendRuntime:
        from cptune.parallel.backends.local.runtime import RUNTIME

        return RUNTIME


POLICY = Local()
