"""What a run with ``cp_backend: deepspeed`` needs (:class:`DeepSpeedUlyssesRuntime`): DeepSpeed, its config,
the Ulysses sharder and the patches that let Ulysses wrap cptune's attention."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cptune.errors import CptuneError
from cptune.parallel.backends import zero
from cptune.parallel.backends.deepspeed_ulysses import NAME
from cptune.parallel.backends.spec import BackendPlan, TrainerParallelism
from cptune.patches.accelerate_patches import torch_cp_context_unavailable

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.data.prepare import PreparedData
    from cptune.parallel.layout import ParallelDims
    from cptune.patches.core import Patch


class DeepSpeedUlyssesRuntime:
    """Loads DeepSpeed, gives the Trainer its Ulysses config, builds the sharder for DeepSpeed's loader adapter."""

    library = None
    # Not reached: accelerate's context is left alone for a backend that does not shard inputs itself.
    cp_context_guard = staticmethod(torch_cp_context_unavailable)

    def check_ready(self, recipe: Recipe, *, training: bool) -> None:
        from cptune.parallel.backends.deepspeed_ulysses import sharding as ulysses

        ulysses.load_deepspeed()
        if training:
            ulysses.check_resume_supported(recipe)
        ulysses.check_core_attention_available(recipe.resolved_ulysses_attn_implementation)
        zero.check_engine_ready(recipe)

    def check_prepared_rows(self, recipe: Recipe, prepared: PreparedData) -> None:
        return None  # the Ulysses collator pads every batch to a length the ranks split evenly

    def trainer_parallelism(self, recipe: Recipe, dims: ParallelDims) -> TrainerParallelism:
        from cptune.parallel.backends.deepspeed_ulysses.sharding import (
            deepspeed_config,
            ulysses_parallelism_config,
        )

        return TrainerParallelism(
            ulysses_parallelism_config(recipe, dims.dp_size, dims.cp_size), deepspeed_config(recipe)
        )

    def plan(self, recipe: Recipe, dims: ParallelDims, pad_token_id: int) -> BackendPlan:
        from cptune.parallel.backends.deepspeed_ulysses import sharding as ulysses

        ulysses.load_deepspeed()
        ulysses.check_resume_supported(recipe)
        core = recipe.resolved_ulysses_attn_implementation
        ulysses.check_core_attention_available(core)
        if core == "cptune":
            from cptune.parallel.backends.document_attention import register_document_attention

            register_document_attention()
        stage = ulysses.deepspeed_config(recipe)["zero_optimization"]["stage"]

        def build(accelerator: Any) -> ulysses.DeepSpeedUlyssesBackend:
            if accelerator.num_processes != dims.world_size:
                raise CptuneError(
                    f"DeepSpeed reports {accelerator.num_processes} processes, but {dims.world_size} were "
                    "launched; the loss would be scaled wrongly. This is a bug in cptune's DeepSpeed setup: "
                    "please report it."
                )
            return ulysses.DeepSpeedUlyssesBackend(
                core_attention=core,
                causal=recipe.causal,
                cp_size=dims.cp_size,
                cp_rank=dims.cp_rank(accelerator.process_index),
                gradient_divisor=ulysses.gradient_divisor(stage, dims.world_size, dims.cp_size),
                pad_token_id=pad_token_id,
                fixed_length=ulysses.gloo_fixed_length(recipe.sequence_len, dims.cp_size),
            )

        return BackendPlan(ulysses.CORE_ATTENTION_NAMES[core], build)

    def training_patches(self) -> Sequence[Patch]:
        from cptune.parallel.backends.deepspeed_ulysses.patches import ulysses_patches
        from cptune.parallel.backends.document_attention import DOCUMENT_ATTENTION_NAME
        from cptune.patches.core import ContextParallelWith

        # DeepSpeed's engine patches come from its runs_own_engine (the registry adds them).
        return ulysses_patches(ContextParallelWith((NAME,)), DOCUMENT_ATTENTION_NAME)

    def import_patches(self) -> Sequence[Patch]:
        return ()


RUNTIME = DeepSpeedUlyssesRuntime()
