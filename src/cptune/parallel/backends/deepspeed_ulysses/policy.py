"""What validation and planning ask of ``cp_backend: deepspeed`` (:class:`DeepSpeedUlysses`). Imports no torch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends import zero
from cptune.parallel.backends.deepspeed_ulysses import NAME

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.spec import BackendRuntime, SequenceSplit
    from cptune.parallel.memory import ModelShape


class DeepSpeedUlysses:
    """Ulysses sequence parallelism: cptune shards the batches, DeepSpeed's attention and engine train."""

    name = NAME
    label = f"cp_backend: {NAME}"
    variant_key = None
    shards_inputs_itself = True
    runs_own_engine = True
    runs_under_zero = False  # its own engine is DeepSpeed's, whatever the recipe says
    attends_whole_layers = False
    splits_heads = True
    takes_tensor_parallel = False
    # cptune shards the batch and gives token coordinates; a pair's two documents share a row only with the
    # document-aware core attention (cptune) or packing, which the rules above already make exact.
    trains_preference_pairs = True

    def run_name(self, recipe: Recipe) -> str:
        return self.label if self.name is None else self.name

    def recipe_rules(self, recipe: Recipe) -> Iterator[tuple[str, str]]:
        """DeepSpeed: Ulysses, and ZeRO under ring-flash-attn or torch CP.

        Ulysses hands the core attention whole rows without a mask: refuse what it would train wrong.
        `zero_stage` and `deepspeed` also run ring-flash-attn and torch CP under DeepSpeed's ZeRO engine
        (each CP group shares one batch, as next to DDP).

        - `ulysses_attn_implementation` applies only to `cp_backend: deepspeed`.
        - At `context_parallel_size: 1`, `zero_stage` and `deepspeed` train with DeepSpeed's ZeRO next to plain
          data parallelism (whole rows on every rank, whatever `cp_backend` says).
        - `zero_stage` and `deepspeed` are refused with `fsdp_version` (one engine shards the model states).
        - With `context_parallel_size > 1` and a core attention other than `cptune`: `causal: false` is
          refused (the others attend causally only); `sample_packing: true` is refused with `sdpa`, and
          with `flash_attention_2/3` needs `micro_batch_size: 1`.
        - `cp_backend: deepspeed` is refused with `fsdp_version` (DeepSpeed shards with its ZeRO stages).
        - At `context_parallel_size > 1`, `eval_batch_size` may not exceed `micro_batch_size` (the Ulysses module is
          built for the training batch's rows).
        """
        r = recipe
        if r.cp_backend != self.name:
            if r.ulysses_attn_implementation is not None:
                yield "ulysses_attn_implementation", "applies only to cp_backend: deepspeed; remove it."
            if zero.asks_for_zero(r):
                yield from _zero_under_cptune_sharding(r)
            return
        if r.fsdp_version is not None:
            yield (
                "fsdp_version",
                "cp_backend: deepspeed shards model states with DeepSpeed's ZeRO stages, not FSDP; use zero_stage: 3 "
                "(weights, gradients and optimizer state sharded) instead of fsdp_version, or another cp_backend.",
            )
        if r.context_parallel_size == 1:
            return  # no Ulysses at cp=1: ZeRO alone, if asked (the local backend's)
        if r.resolved_eval_batch_size > r.micro_batch_size:
            yield (
                "eval_batch_size",
                f"{r.resolved_eval_batch_size} is more rows than micro_batch_size ({r.micro_batch_size}): DeepSpeed's "
                "Ulysses module is built for the training batch's rows and refuses a larger batch. Set "
                "eval_batch_size to micro_batch_size or less, or use another cp_backend.",
            )
        attention = r.resolved_ulysses_attn_implementation
        if attention == "cptune":
            return
        if not r.causal:
            yield (
                "ulysses_attn_implementation",
                f"{attention} attends causally only here (DeepSpeed's Ulysses wrapper drops attention masks); "
                "use ulysses_attn_implementation: cptune with causal: false.",
            )
        if r.sample_packing and attention == "sdpa":
            yield (
                "sample_packing",
                "ulysses_attn_implementation: sdpa cannot keep packed samples apart (DeepSpeed's Ulysses wrapper "
                "drops the mask and sdpa ignores position_ids), so the loss would be silently wrong. Use "
                "ulysses_attn_implementation: cptune (or flash_attention_2 on GPUs), or sample_packing: false.",
            )
        elif r.sample_packing and r.micro_batch_size > 1:
            yield (
                "micro_batch_size",
                f"{attention} finds packed samples from position_ids only in batches of one row "
                "(transformers' _is_packed_sequence); with more rows they would attend to each other. Use "
                "micro_batch_size: 1 with more gradient_accumulation_steps, or ulysses_attn_implementation: cptune.",
            )

    def chunks_per_rank(self, recipe: Recipe) -> int:
        return 1

    def check_model(self, recipe: Recipe, cp_size: int, text_config: Any) -> None:
        # DeepSpeed's core attention has its own check, as flash_attention_2 keeps windows there.
        from cptune.parallel.backends.deepspeed_ulysses.sharding import check_heads

        check_heads(text_config, cp_size, recipe.resolved_ulysses_attn_implementation, causal=recipe.causal)
        if cp_size > 1 and recipe.resolved_ulysses_attn_implementation == "sdpa":
            from cptune.parallel.router_padding import check_router_loss_padding

            check_router_loss_padding(
                recipe, text_config, "cp_backend: deepspeed with ulysses_attn_implementation: sdpa"
            )

    def uses_cptune_attention(self, recipe: Recipe) -> bool:
        return recipe.resolved_ulysses_attn_implementation == "cptune"

    def sequence_split(self, recipe: Recipe) -> SequenceSplit:
        return "heads"

    def plan_lines(self, recipe: Recipe) -> list[str]:
        attention = "causal" if recipe.causal else "bidirectional"
        core = recipe.resolved_ulysses_attn_implementation
        return [f"attention:  {self.name} / Ulysses all-to-all, core attention {core}, {attention}"]

    def attention_buffer_bytes(
        self, recipe: Recipe, shape: ModelShape, cp_size: int, dtype_bytes: int
    ) -> float:
        # Ulysses exchanges Q, K, V and the output for the whole sequence and 1/cp of the heads.
        return 2 * (2 * shape.heads * shape.head_dim + 2 * shape.kv_width) * dtype_bytes

    def zero_stage(self, recipe: Recipe) -> int | None:
        return zero.deepspeed_stage(recipe)  # zero_stage, or the JSON's

    def runtime(self) -> BackendRuntime:
        from cptune.parallel.backends.deepspeed_ulysses.runtime import RUNTIME

        return RUNTIME


def _zero_under_cptune_sharding(r: Recipe) -> Iterator[tuple[str, str]]:
    """`zero_stage` / `deepspeed` with ring-flash-attn or torch CP (or any backend at cp=1)."""
    if r.fsdp_version is not None:
        yield (
            "fsdp_version",
            "shards model states with FSDP2, and deepspeed / zero_stage with DeepSpeed's ZeRO: choose one (remove "
            "fsdp_version, or deepspeed and zero_stage).",
        )


POLICY = DeepSpeedUlysses()
