"""``cp_backend: deepspeed``: DeepSpeed's Ulysses (all-to-all over heads) under DeepSpeed's ZeRO engine.

This module is the backend as the rest of cptune sees it (:class:`DeepSpeedUlysses`, see
:mod:`cptune.parallel.backends.spec`); :mod:`.sharding` builds DeepSpeed's config, puts DeepSpeed's
Ulysses attention in place and gives each rank its slice of every batch. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from cptune.errors import CptuneError
from cptune.parallel.backends import zero
from cptune.parallel.backends.spec import (
    BackendPlan,
    CpBackendName,
    TrainerParallelism,
    accelerate_parallelism,
)

if TYPE_CHECKING:
    from cptune.patches.core import Patch


class DeepSpeedUlysses:
    """Ulysses sequence parallelism: cptune shards the batches, DeepSpeed's attention and engine train."""

    name = CpBackendName.DEEPSPEED
    label = "cp_backend: deepspeed"
    shards_inputs_itself = True
    drives_torch_cp = False
    runs_own_engine = True
    runs_under_zero = False  # its own engine is DeepSpeed's, whatever the recipe says
    attends_whole_layers = False
    splits_heads = True

    def recipe_rules(self, recipe: Any) -> Iterator[tuple[str, str]]:
        """DeepSpeed: Ulysses, and ZeRO under ring-flash-attn or torch CP.

        Ulysses hands the core attention whole rows without a mask: refuse what it would train wrong.
        `zero_stage` and `deepspeed` also run ring-flash-attn and torch CP under DeepSpeed's ZeRO engine
        (each CP group shares one batch, as next to DDP).

        - `ulysses_attn_implementation` applies only to `cp_backend: deepspeed`.
        - `zero_stage` and `deepspeed` need `context_parallel_size > 1` (a cp=1 run trains with plain DDP).
        - `zero_stage` and `deepspeed` are refused with `fsdp_version` (one engine shards the model states).
        - With `context_parallel_size > 1` and a core attention other than `cptune`: `causal: false` is
          refused (the others attend causally only); `sample_packing: true` is refused with `sdpa`, and
          with `flash_attention_2/3` needs `micro_batch_size: 1`.
        - `cp_backend: deepspeed` is refused with `fsdp_version` (DeepSpeed shards with its ZeRO stages).
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
            yield from _deepspeed_at_cp1(r)
            return
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

    def chunks_per_rank(self, recipe: Any) -> int:
        return 1

    def check_ready(self, recipe: Any, *, training: bool) -> None:
        from cptune.parallel.backends.deepspeed_ulysses import sharding as ulysses

        ulysses.load_deepspeed()
        ulysses.check_core_attention_available(recipe.resolved_ulysses_attn_implementation)
        zero.check_engine_ready(recipe)

    def check_model(self, recipe: Any, cp_size: int, text_config: Any) -> None:
        # DeepSpeed's core attention has its own check, as flash_attention_2 keeps windows there.
        from cptune.parallel.backends.deepspeed_ulysses.sharding import check_heads

        check_heads(text_config, cp_size, recipe.resolved_ulysses_attn_implementation)

    def uses_cptune_attention(self, recipe: Any) -> bool:
        return recipe.resolved_ulysses_attn_implementation == "cptune"

    def sequence_split(self, recipe: Any) -> str:
        return "heads"

    def check_prepared_rows(self, recipe: Any, prepared: Any) -> None:
        return None  # every row is padded to a length the ranks split evenly

    def plan_lines(self, recipe: Any) -> list[str]:
        attention = "causal" if recipe.causal else "bidirectional"
        core = recipe.resolved_ulysses_attn_implementation
        return [f"attention:  {self.name} / Ulysses all-to-all, core attention {core}, {attention}"]

    def trainer_parallelism(self, recipe: Any, dims: Any) -> TrainerParallelism:
        from cptune.parallel.backends.deepspeed_ulysses.sharding import deepspeed_config

        # accelerate's mesh as next to DDP (its loader gives a CP group one batch); no sequence-parallel
        # config: cptune shards the batches and puts DeepSpeed's attention in place itself (.sharding).
        return TrainerParallelism(accelerate_parallelism(dims).parallelism, deepspeed_config(recipe))

    def plan(self, recipe: Any, dims: Any, pad_token_id: int) -> BackendPlan:
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
                recipe.micro_batch_size,
            )
            return ulysses.DeepSpeedUlyssesBackend(
                core_attention=core,
                causal=recipe.causal,
                cp_size=dims.cp_size,
                cp_rank=cp_mesh.get_local_rank(),
                micro_batch_size=recipe.micro_batch_size,
                pad_token_id=pad_token_id,
            )

        return BackendPlan(ulysses.CORE_ATTENTION_NAMES[core], build)

    def training_patches(self) -> Sequence[Patch]:
        from cptune.patches.core import ContextParallelWith
        from cptune.patches.deepspeed_patches import ulysses_patches

        # DeepSpeed's engine patches come from its runs_own_engine, those it shares with ring-flash-attn and
        # torch CP from its shards_inputs_itself (the registry adds them).
        return ulysses_patches(ContextParallelWith((self.name,)))

    def import_patches(self) -> Sequence[Patch]:
        return ()

    def attention_buffer_bytes(self, shape: Any, setup: Any) -> float:
        # Ulysses exchanges Q, K, V and the output for the whole sequence and 1/cp of the heads.
        return 2 * (2 * shape.heads * shape.head_dim + 2 * shape.kv_width) * setup.dtype_bytes

    def zero_stage(self, recipe: Any) -> int | None:
        return zero.deepspeed_stage(recipe)  # zero_stage, or the JSON's


def _deepspeed_at_cp1(r: Any) -> Iterator[tuple[str, str]]:
    for key in ("zero_stage", "deepspeed"):
        if getattr(r, key) is not None:
            yield (
                key,
                "DeepSpeed runs only with context_parallel_size > 1 (a cp=1 run trains with plain DDP): set "
                "context_parallel_size, or remove it (to shard model states without CP use fsdp_version: 2).",
            )


def _zero_under_cptune_sharding(r: Any) -> Iterator[tuple[str, str]]:
    """`zero_stage` / `deepspeed` with ring-flash-attn or torch CP (or any backend at cp=1)."""
    if r.context_parallel_size == 1:
        yield from _deepspeed_at_cp1(r)
        return
    if r.fsdp_version is not None:
        yield (
            "fsdp_version",
            "shards model states with FSDP2, and deepspeed / zero_stage with DeepSpeed's ZeRO: choose one (remove "
            "fsdp_version, or deepspeed and zero_stage).",
        )


DEEPSPEED_ULYSSES = DeepSpeedUlysses()
