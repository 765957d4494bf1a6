"""What a run with ``cp_backend: ring-flash-attn`` needs (:class:`RingFlashAttnRuntime`): its package, its sharder."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends import zero
from cptune.parallel.backends.spec import BackendPlan, TrainerParallelism
from cptune.patches.accelerate_patches import torch_cp_context_unavailable

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.data.prepare import PreparedData
    from cptune.parallel.backends.ring_flash_attn.sharding import RingFlashAttnBackend
    from cptune.parallel.layout import ParallelDims
    from cptune.patches.core import Patch


class RingFlashAttnRuntime:
    """Loads ring-flash-attn (patched around its import), builds the ring sharder, next to DDP/FSDP2 or ZeRO."""

    library = "ring_flash_attn"
    cp_context_guard = staticmethod(torch_cp_context_unavailable)

    def check_ready(self, recipe: Recipe, *, training: bool) -> None:
        import torch

        from cptune.parallel.backends.ring_flash_attn.kernel_choice import check_ring_precision
        from cptune.parallel.backends.ring_flash_attn.sharding import load_ring_flash_attn
        from cptune.parallel.kernels import flash_attn_available

        check_ring_precision(recipe, cuda=torch.cuda.is_available(), flash_attn=flash_attn_available())
        load_ring_flash_attn()
        zero.check_ready_under_zero(recipe)

    def check_prepared_rows(self, recipe: Recipe, prepared: PreparedData) -> None:
        return None  # varlen_llama3 and zigzag take any rows the data preparation makes

    def trainer_parallelism(self, recipe: Recipe, dims: ParallelDims) -> TrainerParallelism:
        return zero.parallelism_under_zero(recipe, dims)

    def plan(self, recipe: Recipe, dims: ParallelDims, pad_token_id: int, model_config: Any) -> BackendPlan:
        import logging

        import torch

        from cptune.parallel.backends.attention import ATTENTION_NAME
        from cptune.parallel.backends.ring_flash_attn.kernel_choice import (
            check_ring_precision,
            describe_ring_kernels,
        )
        from cptune.parallel.backends.ring_flash_attn.sharding import (
            RingFlashAttnBackend,
            load_ring_flash_attn,
        )
        from cptune.parallel.kernels import flash_attn_available

        cuda, flash_attn = torch.cuda.is_available(), flash_attn_available()
        check_ring_precision(recipe, cuda=cuda, flash_attn=flash_attn)
        choice = describe_ring_kernels(recipe, cuda=cuda, flash_attn=flash_attn)
        if choice.slow_warning is not None:
            logging.getLogger("cptune.backends").warning("%s", choice.slow_warning)
        kernels = load_ring_flash_attn()

        def build(accelerator: Any, model: Any) -> RingFlashAttnBackend:
            cp_mesh = accelerator.torch_device_mesh["cp"]
            return RingFlashAttnBackend(
                func=recipe.resolved_ring_attn_func,
                causal=recipe.causal,
                heads_k_stride=recipe.heads_k_stride,
                cp_size=dims.cp_size,
                cp_rank=cp_mesh.get_local_rank(),
                group=cp_mesh.get_group(),
                pad_token_id=pad_token_id,
                kernels=kernels,
            )

        return BackendPlan(ATTENTION_NAME, build)

    def training_patches(self) -> Sequence[Patch]:
        return ()  # those it shares with torch come from its shards_inputs_itself and runs_under_zero

    def import_patches(self) -> Sequence[Patch]:
        from cptune.parallel.backends.ring_flash_attn.patches import import_patches

        return import_patches()


RUNTIME = RingFlashAttnRuntime()
