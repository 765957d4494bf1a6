"""What validation and planning ask of ``cp_backend: toy``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends.toy import NAME

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.spec import BackendRuntime, SequenceSplit
    from cptune.parallel.memory import ModelShape


class Toy:
    """A ring that shards inputs itself and keeps no packed documents apart."""

    name = NAME
    label = f"cp_backend: {NAME}"
    variant_key = None
    shards_inputs_itself = True
    runs_own_engine = False
    runs_under_zero = False
    attends_whole_layers = True
    splits_heads = False
    takes_tensor_parallel = False
    trains_preference_pairs = False

    def run_name(self, recipe: Recipe) -> str:
        return self.label if self.name is None else self.name

    def recipe_rules(self, recipe: Recipe) -> Iterator[tuple[str, str]]:
        """toy.

        - `toy_ring_rounds` applies only to `cp_backend: toy`; the toy refuses `sample_packing: true`.
        """
        if recipe.toy_ring_rounds is not None and recipe.cp_backend != self.name:
            yield "toy_ring_rounds", "applies only to cp_backend: toy; remove it."
        if recipe.cp_backend == self.name and recipe.context_parallel_size > 1 and recipe.sample_packing:
            yield (
                "sample_packing",
                "cp_backend: toy cannot keep packed samples apart; set sample_packing: false.",
            )

    def chunks_per_rank(self, recipe: Recipe) -> int:
        return 1

    def check_model(self, recipe: Recipe, cp_size: int, text_config: Any) -> None:
        return None

    def uses_cptune_attention(self, recipe: Recipe) -> bool:
        return True

    def sequence_split(self, recipe: Recipe) -> SequenceSplit:
        return "contiguous"

    def plan_lines(self, recipe: Recipe) -> list[str]:
        return [f"attention:  {self.name} / {recipe.toy_ring_rounds or 1} round(s)"]

    def attention_buffer_bytes(
        self, recipe: Recipe, shape: ModelShape, cp_size: int, dtype_bytes: int
    ) -> float:
        return 2.0 * cp_size * shape.kv_width * dtype_bytes

    def zero_stage(self, recipe: Recipe) -> int | None:
        return None

    def runtime(self) -> BackendRuntime:
        from cptune.parallel.backends.toy.runtime import RUNTIME

        return RUNTIME


POLICY = Toy()
