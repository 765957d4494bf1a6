"""What a run with ``cp_backend: deepspeed`` needs (:class:`DeepSpeedUlyssesRuntime`): DeepSpeed, its config,
DeepSpeed's Ulysses attention in place, the sharder and the patch that scopes that attention to the run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cptune.errors import CptuneError
from cptune.parallel.backends import zero
from cptune.parallel.backends.deepspeed_ulysses import NAME
from cptune.parallel.backends.spec import BackendPlan, TrainerParallelism, accelerate_parallelism
from cptune.patches.accelerate_patches import torch_cp_context_unavailable

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.data.prepare import PreparedData
    from cptune.parallel.layout import ParallelDims
    from cptune.patches.core import Patch


class DeepSpeedUlyssesRuntime:
    """Loads DeepSpeed, gives the Trainer DeepSpeed's config, puts Ulysses' attention in place, builds the sharder."""

    library = None
    cp_context_guard = staticmethod(torch_cp_context_unavailable)

    def check_ready(self, recipe: Recipe, *, training: bool) -> None:
        from cptune.parallel.backends.deepspeed_ulysses import sharding as ulysses

        ulysses.load_deepspeed()
        ulysses.check_core_attention_available(recipe.resolved_ulysses_attn_implementation)
        zero.check_engine_ready(recipe)

    def check_prepared_rows(self, recipe: Recipe, prepared: PreparedData) -> None:
        return None  # every row is padded to a length the ranks split evenly

    def trainer_parallelism(self, recipe: Recipe, dims: ParallelDims) -> TrainerParallelism:
        from cptune.parallel.backends.deepspeed_ulysses.sharding import deepspeed_config

        # accelerate's mesh as next to DDP (its loader gives a CP group one batch); no sequence-parallel
        # config: cptune shards the batches and puts DeepSpeed's attention in place itself (.sharding).
        return TrainerParallelism(accelerate_parallelism(dims).parallelism, deepspeed_config(recipe))

    def plan(self, recipe: Recipe, dims: ParallelDims, pad_token_id: int, model_config: Any) -> BackendPlan:
        from cptune.parallel.backends.deepspeed_ulysses import sharding as ulysses

        ulysses.load_deepspeed()
        core = recipe.resolved_ulysses_attn_implementation
        ulysses.check_core_attention_available(core)
        if core == "cptune":
            from cptune.parallel.backends.document_attention import register_document_attention

            register_document_attention()
        ulysses.deepspeed_config(recipe)  # reads and checks the JSON before the model is loaded

        def build(accelerator: Any, model: Any) -> ulysses.DeepSpeedUlyssesBackend:
            if accelerator.num_processes != dims.world_size:
                raise CptuneError(
                    f"DeepSpeed reports {accelerator.num_processes} processes, but {dims.world_size} were "
                    "launched; the loss would be scaled wrongly. This is a bug in cptune's DeepSpeed setup: "
                    "please report it."
                )
            cp_mesh = accelerator.torch_device_mesh["cp"]
            ulysses.install_ulysses_attention(
                model.config.get_text_config(),
                ulysses.CORE_ATTENTION_NAMES[core],
                cp_mesh.get_group(),
                recipe.rows_per_micro_batch,  # DeepSpeed's module reshapes with it
            )
            return ulysses.DeepSpeedUlyssesBackend(
                core_attention=core,
                causal=recipe.causal,
                cp_size=dims.cp_size,
                cp_rank=cp_mesh.get_local_rank(),
                micro_batch_size=recipe.rows_per_micro_batch,
                pad_token_id=pad_token_id,
                kv_heads_per_call=recipe.attention_kv_heads_per_call,
            )

        return BackendPlan(ulysses.CORE_ATTENTION_NAMES[core], build)

    def training_patches(self) -> Sequence[Patch]:
        from cptune.parallel.backends.deepspeed_ulysses.patches import ulysses_patches
        from cptune.patches.core import ContextParallelWith

        # DeepSpeed's engine patches come from its runs_own_engine, those it shares with ring-flash-attn and
        # torch CP from its shards_inputs_itself (the registry adds them).
        return ulysses_patches(ContextParallelWith((NAME,)))

    def import_patches(self) -> Sequence[Patch]:
        return ()


RUNTIME = DeepSpeedUlyssesRuntime()
