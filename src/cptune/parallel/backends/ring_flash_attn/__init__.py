"""``cp_backend: ring-flash-attn``: ring attention with ring-flash-attn's functions (varlen_llama3 or zigzag).

This module is the backend as the rest of cptune sees it (:class:`RingFlashAttn`, see
:mod:`cptune.parallel.backends.spec`); :mod:`.sharding` shards batches and calls the kernels,
:mod:`.kernel_choice` says which kernels run here. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends import zero
from cptune.parallel.backends.spec import BackendPlan, CpBackendName, TrainerParallelism

if TYPE_CHECKING:
    from cptune.patches.core import Patch


class RingFlashAttn:
    """ring-flash-attn's varlen_llama3 (document-aware, all-gathered K/V) or batch_zigzag ring."""

    name = CpBackendName.RING_FLASH_ATTN
    label = "cp_backend: ring-flash-attn"
    shards_inputs_itself = True
    drives_torch_cp = False
    runs_own_engine = False
    runs_under_zero = True
    attends_whole_layers = True
    splits_heads = False

    def recipe_rules(self, recipe: Any) -> Iterator[tuple[str, str]]:
        """ring-flash-attn.

        - `ring_attn_func` applies only to `cp_backend: ring-flash-attn`.
        - `ring_attn_func: batch_zigzag` is refused with `sample_packing: true` (it has no document
          boundaries), with `causal: false` (causal only) and without `bf16: true` (ring-flash-attn 0.1.8
          computes wrong zigzag gradients in fp32/fp16).
        """
        r = recipe
        if r.ring_attn_func is not None and r.cp_backend != self.name:
            yield "ring_attn_func", "applies only to cp_backend: ring-flash-attn; remove it."
        if r.resolved_ring_attn_func == "batch_zigzag":
            if r.sample_packing:
                yield (
                    "ring_attn_func",
                    "batch_zigzag cannot keep packed samples apart (it has no document boundaries); "
                    "use ring_attn_func: varlen_llama3 with sample_packing.",
                )
            if not r.causal:
                yield "ring_attn_func", "batch_zigzag is causal only; use varlen_llama3 with causal: false."
            if r.bf16 is not True:
                yield (
                    "ring_attn_func",
                    "batch_zigzag needs bf16: true. ring-flash-attn 0.1.8 computes wrong gradients for "
                    "zigzag in fp32/fp16 (its fp32 accumulator aliases a kernel buffer). "
                    "Use bf16: true, or ring_attn_func: varlen_llama3, which is exact in fp32.",
                )

    def chunks_per_rank(self, recipe: Any) -> int:
        return 2 if recipe.resolved_ring_attn_func == "batch_zigzag" else 1

    def check_ready(self, recipe: Any, *, training: bool) -> None:
        import torch

        from cptune.parallel.backends.ring_flash_attn.kernel_choice import check_ring_precision
        from cptune.parallel.backends.ring_flash_attn.sharding import load_ring_flash_attn
        from cptune.parallel.kernels import flash_attn_available

        check_ring_precision(recipe, cuda=torch.cuda.is_available(), flash_attn=flash_attn_available())
        load_ring_flash_attn()
        zero.check_ready_under_zero(recipe)

    def check_model(self, recipe: Any, cp_size: int, text_config: Any) -> None:
        if recipe.resolved_ring_attn_func == "varlen_llama3":
            from cptune.parallel.backends.ring_flash_attn.sharding import check_heads_k_stride

            kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
            check_heads_k_stride(kv_heads, recipe.heads_k_stride)

    def uses_cptune_attention(self, recipe: Any) -> bool:
        return True

    def sequence_split(self, recipe: Any) -> str:
        return "zigzag" if recipe.resolved_ring_attn_func == "batch_zigzag" else "contiguous"

    def check_prepared_rows(self, recipe: Any, prepared: Any) -> None:
        return None  # varlen_llama3 and zigzag take any rows the data preparation makes

    def plan_lines(self, recipe: Any) -> list[str]:
        import torch

        from cptune.parallel.backends.ring_flash_attn.kernel_choice import describe_ring_kernels
        from cptune.parallel.kernels import flash_attn_available

        choice = describe_ring_kernels(
            recipe, cuda=torch.cuda.is_available(), flash_attn=flash_attn_available()
        )
        attention = "causal" if recipe.causal else "bidirectional"
        lines = [
            f"attention:  {self.name} / {recipe.resolved_ring_attn_func}, {attention}, "
            f"heads_k_stride={recipe.heads_k_stride}, kernels: {choice.name}"
        ]
        if choice.slow_warning is not None:
            lines.append(f"warning:    {choice.slow_warning}")
        return lines

    def trainer_parallelism(self, recipe: Any, dims: Any) -> TrainerParallelism:
        return zero.parallelism_under_zero(recipe, dims)

    def plan(self, recipe: Any, dims: Any, pad_token_id: int) -> BackendPlan:
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
        from cptune.parallel.kernels import flash_attn_shim_patches
        from cptune.patches.transformers_patches import ring_flash_attn_import_compat_patch

        return (ring_flash_attn_import_compat_patch(), *flash_attn_shim_patches())

    def attention_buffer_bytes(self, shape: Any, setup: Any) -> float:
        # varlen_llama3 all-gathers heads_k_stride KV heads of the whole sequence into two double buffers.
        return 2 * 2 * setup.cp_size * setup.heads_k_stride * shape.head_dim * setup.dtype_bytes

    def zero_stage(self, recipe: Any) -> int | None:
        return zero.stage_under_zero(recipe)


RING_FLASH_ATTN = RingFlashAttn()
