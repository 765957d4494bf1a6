"""What validation and planning ask of ``cp_backend: ring-flash-attn`` (:class:`RingFlashAttn`). Imports no torch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends import zero
from cptune.parallel.backends.ring_flash_attn import NAME

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.spec import BackendRuntime, SequenceSplit
    from cptune.parallel.memory import ModelShape


class RingFlashAttn:
    """ring-flash-attn's varlen_llama3 (document-aware, all-gathered K/V) or batch_zigzag ring."""

    name = NAME
    label = f"cp_backend: {NAME}"
    variant_key = "ring_attn_func"
    shards_inputs_itself = True
    runs_own_engine = False
    runs_under_zero = True
    # both ring functions take sliding windows (causal); check_model refuses what they cannot
    attends_whole_layers = False
    splits_heads = False
    takes_tensor_parallel = True
    trains_preference_pairs = True

    def recipe_rules(self, recipe: Recipe) -> Iterator[tuple[str, str]]:
        """ring-flash-attn.

        - `ring_attn_func` applies only to `cp_backend: ring-flash-attn`.
        - `ring_attn_func: batch_zigzag` is refused with `sample_packing: true` and with `rl` (it has no
          document boundaries, and a preference pair is two documents in one row), with `causal: false` (causal only) and without `bf16: true` (ring-flash-attn 0.1.8
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
            if r.rl is not None:
                yield (
                    "ring_attn_func",
                    "batch_zigzag cannot keep a preference pair's chosen and rejected sequences apart (a pair is "
                    "two documents in one row, and it has no document boundaries); use ring_attn_func: "
                    "varlen_llama3 with rl.",
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

    def chunks_per_rank(self, recipe: Recipe) -> int:
        return 2 if recipe.resolved_ring_attn_func == "batch_zigzag" else 1

    def check_model(self, recipe: Recipe, cp_size: int, text_config: Any) -> None:
        from cptune.parallel.backends.attention import check_window_support

        func = recipe.resolved_ring_attn_func
        computed_by = f"{self.label} (ring_attn_func: {func})"
        # varlen_llama3: each rank's queries attend keys from their document's start with bottom-right
        # alignment, so flash-attn's window counts positions of the whole document (sharding.py).
        # batch_zigzag: cptune's zigzag ring gives each block its offset in the row (zigzag_window.py).
        check_window_support(text_config, computed_by, causal=recipe.causal)
        # Attention sinks: both apply them once to each query's merged attention (varlen_llama3's gathered
        # attention in sharding.Llama3Attention, the zigzag ring's in zigzag_window.ZigzagRing).
        if func == "batch_zigzag" and cp_size > 1:
            # The zigzag ring has no documents: collator padding would see the row and route otherwise.
            from cptune.parallel.router_padding import check_router_loss_padding

            check_router_loss_padding(recipe, text_config, computed_by)
        if func == "varlen_llama3":
            from cptune.parallel.backends.ring_flash_attn.sharding import check_heads_k_stride

            kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
            check_heads_k_stride(kv_heads, recipe.heads_k_stride)

    def uses_cptune_attention(self, recipe: Recipe) -> bool:
        return True

    def run_name(self, recipe: Recipe) -> str:
        return f"{self.name} / {recipe.resolved_ring_attn_func}"

    def sequence_split(self, recipe: Recipe) -> SequenceSplit:
        return "zigzag" if recipe.resolved_ring_attn_func == "batch_zigzag" else "contiguous"

    def plan_lines(self, recipe: Recipe) -> list[str]:
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

    def attention_buffer_bytes(
        self, recipe: Recipe, shape: ModelShape, cp_size: int, dtype_bytes: int
    ) -> float:
        # varlen_llama3 all-gathers heads_k_stride KV heads of the whole sequence into two double buffers.
        return 2 * 2 * cp_size * recipe.heads_k_stride * shape.head_dim * dtype_bytes

    def zero_stage(self, recipe: Recipe) -> int | None:
        return zero.stage_under_zero(recipe)

    def runtime(self) -> BackendRuntime:
        from cptune.parallel.backends.ring_flash_attn.runtime import RUNTIME

        return RUNTIME


POLICY = RingFlashAttn()
