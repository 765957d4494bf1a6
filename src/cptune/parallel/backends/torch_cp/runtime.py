"""What a run with ``cp_backend: torch`` needs (:class:`TorchCpRuntime`): its sharder and torch's CPU handlers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends import zero
from cptune.parallel.backends.spec import BackendPlan, TrainerParallelism
from cptune.parallel.backends.torch_cp import NAME
from cptune.parallel.backends.torch_cp.patches import torch_cp_context_owned_by_backend

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.data.prepare import PreparedData
    from cptune.parallel.backends.torch_cp.sharding import TorchCpBackend
    from cptune.parallel.layout import ParallelDims
    from cptune.patches.core import Patch


class TorchCpRuntime:
    """Builds the torch CP sharder (which drives torch's dispatch around each step), next to DDP/FSDP2 or ZeRO."""

    library = None
    cp_context_guard = staticmethod(torch_cp_context_owned_by_backend)

    def check_ready(self, recipe: Recipe, *, training: bool) -> None:
        # torch's context parallelism ships with torch; the recipe rules cover the rest.
        zero.check_ready_under_zero(recipe)

    def check_prepared_rows(self, recipe: Recipe, prepared: PreparedData) -> None:
        """With ``causal: false``: rows of one document whose length splits evenly over the CP ranks and,
        with more than one row per batch, rows of one length (:func:`.sharding.check_bidirectional_rows`)."""
        if recipe.context_parallel_size == 1 or recipe.causal:
            return
        if recipe.pad_to_sequence_len:
            return  # batches are not the rows as prepared; the recipe rules refuse this with causal: false
        import pyarrow.compute as pc

        from cptune.parallel.backends.torch_cp.sharding import check_bidirectional_rows

        eval_key = "eval_batch_size" if recipe.eval_batch_size else "micro_batch_size"
        splits = (
            ("training", prepared.train, recipe.micro_batch_size, "micro_batch_size"),
            ("evaluation", prepared.eval, recipe.resolved_eval_batch_size, eval_key),
        )
        for split, rows, batch_size, key in splits:
            if rows is None or len(rows) == 0:
                continue
            lengths = pc.list_value_length(rows.with_format("arrow")["input_ids"]).to_pylist()
            check_bidirectional_rows(
                lengths,
                split=split,
                cp_size=recipe.context_parallel_size,
                micro_batch_size=batch_size,
                batch_key=key,
            )

    def trainer_parallelism(self, recipe: Recipe, dims: ParallelDims) -> TrainerParallelism:
        return zero.parallelism_under_zero(recipe, dims)

    def plan(self, recipe: Recipe, dims: ParallelDims, pad_token_id: int, model_config: Any) -> BackendPlan:
        from cptune.parallel.backends.attention import ATTENTION_NAME
        from cptune.parallel.backends.torch_cp.sharding import TorchCpBackend

        def build(accelerator: Any, model: Any) -> TorchCpBackend:
            return TorchCpBackend(
                causal=recipe.causal,
                load_balance=recipe.resolved_cp_load_balance,
                comm_strategy=recipe.resolved_cp_comm_strategy,
                cp_mesh=accelerator.torch_device_mesh["cp"],
                pad_token_id=pad_token_id,
            )

        return BackendPlan(ATTENTION_NAME, build)

    def training_patches(self) -> Sequence[Patch]:
        from cptune.parallel.backends.torch_cp.patches import torch_cp_cpu_sdpa_patch
        from cptune.patches.core import ContextParallelWith, WithoutCuda

        # On CUDA torch's context parallelism has handlers for the GPU attention ops itself.
        return (torch_cp_cpu_sdpa_patch(WithoutCuda(ContextParallelWith((NAME,)))),)

    def import_patches(self) -> Sequence[Patch]:
        return ()


RUNTIME = TorchCpRuntime()
