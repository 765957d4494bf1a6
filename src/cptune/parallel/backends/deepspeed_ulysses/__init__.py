"""``cp_backend: deepspeed``: DeepSpeed's Ulysses (all-to-all over heads) under DeepSpeed's ZeRO engine.

This module is the backend as the rest of cptune sees it (:class:`DeepSpeedUlysses`, see
:mod:`cptune.parallel.backends.spec`); :mod:`.sharding` builds DeepSpeed's config, loads it
and gives each rank its model inputs. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from cptune.errors import CptuneError
from cptune.parallel.backends.spec import BackendPlan, CpBackendName, TrainerParallelism

if TYPE_CHECKING:
    from cptune.patches.core import Patch


def zero3_memory_problems(r: Any) -> Iterator[tuple[str, str]]:
    """The memory features that DeepSpeed ZeRO-3 cannot serve yet (also checked for a `deepspeed` JSON's stage)."""
    for key, on in (("tiled_mlp", r.tiled_mlp), ("cut_cross_entropy", r.resolved_head_loss)):
        if on:
            yield (
                key,
                "is not supported with DeepSpeed ZeRO-3 yet: it calls modules again in the backward pass, after "
                "ZeRO-3 released their gathered weights. Use zero_stage 0-2, or remove it "
                "(activation_offloading works with ZeRO-3).",
            )


class DeepSpeedUlysses:
    """Ulysses sequence parallelism: DeepSpeed's loader adapter shards, its engine trains."""

    name = CpBackendName.DEEPSPEED
    label = "cp_backend: deepspeed"
    shards_inputs_itself = False
    drives_torch_cp = False
    runs_own_engine = True
    attends_whole_layers = False
    splits_heads = True

    def recipe_rules(self, recipe: Any) -> Iterator[tuple[str, str]]:
        """DeepSpeed Ulysses.

        Ulysses hands the core attention whole rows without a mask: refuse what it would train wrong.

        - `ulysses_attn_implementation`, `zero_stage` and `deepspeed` apply only to `cp_backend: deepspeed`
          (ring-flash-attn and torch CP cannot run under DeepSpeed's engine: accelerate gives each rank of a
          DeepSpeed run a batch of its own, so a CP group would split different sequences).
        - `zero_stage` and `deepspeed` need `context_parallel_size > 1` (a cp=1 run trains with plain DDP).
        - With `context_parallel_size > 1` and a core attention other than `cptune`: `causal: false` is
          refused (the others attend causally only); `sample_packing: true` is refused with `sdpa`, and
          with `flash_attention_2/3` needs `micro_batch_size: 1`.
        - `cp_backend: deepspeed` is refused with `fsdp_version` (DeepSpeed shards with its ZeRO stages).
        - `tiled_mlp` and `cut_cross_entropy` are refused with `zero_stage: 3` (they call modules again in
          the backward pass, after ZeRO-3 released their weights; a `deepspeed` JSON's stage is checked
          before launching).
        """
        r = recipe
        if r.cp_backend != self.name:
            if r.ulysses_attn_implementation is not None:
                yield "ulysses_attn_implementation", "applies only to cp_backend: deepspeed; remove it."
            for key in ("zero_stage", "deepspeed"):
                if getattr(r, key) is not None:
                    yield key, _deepspeed_needs_ulysses(r)
            return
        if r.fsdp_version is not None:
            yield (
                "fsdp_version",
                "cp_backend: deepspeed shards model states with DeepSpeed's ZeRO stages, not FSDP; use zero_stage: 3 "
                "(weights, gradients and optimizer state sharded) instead of fsdp_version, or another cp_backend.",
            )
        if r.zero_stage == 3:
            yield from zero3_memory_problems(r)
        if r.context_parallel_size == 1:
            for key in ("zero_stage", "deepspeed"):
                if getattr(r, key) is not None:
                    yield (
                        key,
                        "DeepSpeed runs only with context_parallel_size > 1 (a cp=1 run trains with plain DDP); "
                        "remove it, or set context_parallel_size.",
                    )
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
        if training:
            ulysses.check_resume_supported(recipe)
        ulysses.check_core_attention_available(recipe.resolved_ulysses_attn_implementation)
        stage = ulysses.deepspeed_config(recipe)["zero_optimization"]["stage"]  # reads and checks the JSON
        for key, _ in zero3_memory_problems(recipe) if stage == 3 else ():
            raise CptuneError(
                f"{key}: the DeepSpeed JSON {recipe.deepspeed} sets ZeRO stage 3, which frees each module's "
                f"gathered weights after its forward pass, but {key} calls modules again in the backward pass "
                "(not supported yet). Use a ZeRO stage below 3, or remove it."
            )

    def check_model(self, recipe: Any, cp_size: int, text_config: Any) -> None:
        # DeepSpeed's core attention has its own check, as flash_attention_2 keeps windows there.
        from cptune.parallel.backends.deepspeed_ulysses.sharding import check_heads

        check_heads(text_config, cp_size, recipe.resolved_ulysses_attn_implementation)

    def uses_cptune_attention(self, recipe: Any) -> bool:
        return recipe.resolved_ulysses_attn_implementation == "cptune"

    def sequence_split(self, recipe: Any) -> str:
        return "heads"

    def check_prepared_rows(self, recipe: Any, prepared: Any) -> None:
        return None  # the Ulysses collator pads every batch to a length the ranks split evenly

    def plan_lines(self, recipe: Any) -> list[str]:
        attention = "causal" if recipe.causal else "bidirectional"
        core = recipe.resolved_ulysses_attn_implementation
        return [f"attention:  {self.name} / Ulysses all-to-all, core attention {core}, {attention}"]

    def trainer_parallelism(self, recipe: Any, dims: Any) -> TrainerParallelism:
        from cptune.parallel.backends.deepspeed_ulysses.sharding import (
            deepspeed_config,
            ulysses_parallelism_config,
        )

        return TrainerParallelism(
            ulysses_parallelism_config(recipe, dims.dp_size, dims.cp_size), deepspeed_config(recipe)
        )

    def plan(self, recipe: Any, dims: Any, pad_token_id: int) -> BackendPlan:
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
        from cptune.parallel.backends.document_attention import DOCUMENT_ATTENTION_NAME
        from cptune.patches.core import ContextParallelWith
        from cptune.patches.deepspeed_patches import deepspeed_patches

        return deepspeed_patches(ContextParallelWith((self.name,)), DOCUMENT_ATTENTION_NAME)

    def import_patches(self) -> Sequence[Patch]:
        return ()

    def attention_buffer_bytes(self, shape: Any, setup: Any) -> float:
        # Ulysses exchanges Q, K, V and the output for the whole sequence and 1/cp of the heads.
        return 2 * (2 * shape.heads * shape.head_dim + 2 * shape.kv_width) * setup.dtype_bytes

    def zero_stage(self, recipe: Any) -> int | None:
        from cptune.parallel.backends.deepspeed_ulysses.sharding import deepspeed_config

        return int(deepspeed_config(recipe)["zero_optimization"]["stage"])  # zero_stage, or the JSON's


def _deepspeed_needs_ulysses(r: Any) -> str:
    if r.context_parallel_size == 1:
        return (
            "DeepSpeed runs only as cp_backend: deepspeed with context_parallel_size > 1 (a cp=1 run trains with "
            "plain DDP); to shard model states without CP use fsdp_version: 2, or remove it."
        )
    # accelerate 1.15 (data_loader.py, prepare_data_loader): under DeepSpeed only a tp mesh axis makes ranks
    # share batches, so the ranks of a CP group would each get a batch of their own.
    return (
        f"DeepSpeed's engine cannot run cp_backend: {r.cp_backend}: under DeepSpeed, accelerate gives every rank "
        "a batch of its own (its data loader ignores the context-parallel axis), so the ranks of a CP group "
        "would split different sequences. Set cp_backend: deepspeed (Ulysses, which runs under DeepSpeed's ZeRO "
        f"stages), or shard model states with fsdp_version: 2 and keep cp_backend: {r.cp_backend}."
    )


DEEPSPEED_ULYSSES = DeepSpeedUlysses()
