"""What a run at context_parallel_size 1 needs (:class:`LocalRuntime`): the whole-row sharder, accelerate's mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends import zero
from cptune.parallel.backends.spec import BackendPlan, TrainerParallelism
from cptune.patches.accelerate_patches import torch_cp_context_unavailable

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.data.prepare import PreparedData
    from cptune.parallel.layout import ParallelDims
    from cptune.patches.core import Patch


class LocalRuntime:
    """Whole rows on every rank, next to plain DDP, FSDP2 or DeepSpeed's ZeRO (``deepspeed`` / ``zero_stage``)."""

    library = None
    cp_context_guard = staticmethod(torch_cp_context_unavailable)

    def check_ready(self, recipe: Recipe, *, training: bool) -> None:
        zero.check_ready_under_zero(recipe)

    def check_prepared_rows(self, recipe: Recipe, prepared: PreparedData) -> None:
        return None

    def trainer_parallelism(self, recipe: Recipe, dims: ParallelDims) -> TrainerParallelism:
        # FSDP2 without CP still needs accelerate's mesh; deepspeed / zero_stage add DeepSpeed's config to it.
        return zero.parallelism_under_zero(recipe, dims)

    def plan(self, recipe: Recipe, dims: ParallelDims, pad_token_id: int, model_config: Any) -> BackendPlan:
        from cptune.parallel.backends.local.sharding import LocalBackend

        local = LocalBackend(
            causal=recipe.causal,
            documents=attends_by_document(recipe, model_config),
            kv_heads_per_call=recipe.attention_kv_heads_per_call,
            transformers_attention=transformers_attention(model_config),
        )
        return BackendPlan(local.attn_implementation, lambda accelerator, model: local)

    def training_patches(self) -> Sequence[Patch]:
        return ()

    def import_patches(self) -> Sequence[Patch]:
        return ()


def transformers_attention(model_config: Any) -> str:
    """transformers' attention for a cp=1 run that leaves attention to the model: ``sdpa``, or ``eager`` where the
    model's class has no sdpa path (Gemma 2, VaultGemma in transformers 5.23; eager keeps a tokens x tokens matrix
    of attention weights per head)."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(model_config), None)
    if model_class is not None and not getattr(model_class, "_supports_sdpa", True):
        return "eager"
    return "sdpa"


def attends_by_document(recipe: Recipe, model_config: Any) -> bool:
    """Whether cp=1 attends each document within itself (cptune's attention) rather than through a mask.

    Always for ``causal: false`` (cptune's attention computes it either way). For causal training,
    whenever cptune's attention can compute the model's: full attention in every layer (a sliding
    window needs transformers' masks), routed through transformers' AttentionInterface, and no
    attention dropout. Otherwise transformers' ``sdpa`` runs, which keeps the documents of a row
    (padding included) apart through a ``rows x tokens x tokens`` boolean mask: 256 GiB at 512K tokens.
    A model with attention sinks (gpt-oss) has no ``sdpa`` in transformers, and transformers 5.23's
    gpt-oss forward builds its masks without ``position_ids``, so it would let packed documents attend
    to each other: cptune's attention takes it, with its sliding windows and sinks.
    """
    if not recipe.causal:
        return True
    from transformers import AutoModelForCausalLM

    from cptune.parallel.backends.attention import SLIDING_ATTENTION, has_sinks, windowed_layer_types

    text = model_config.get_text_config()
    model_class = AutoModelForCausalLM._model_mapping.get(type(model_config), None)
    kinds = windowed_layer_types(text)
    return (
        (not kinds or (has_sinks(text) and kinds == [SLIDING_ATTENTION]))
        and bool(getattr(model_class, "_supports_attention_backend", False))
        and not getattr(text, "attention_dropout", 0.0)
    )


RUNTIME = LocalRuntime()
