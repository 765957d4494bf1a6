"""What is the same for every backend around what a backend answers itself.

The backend is the run plan's (:class:`cptune.run.plan.RunPlan`, from :mod:`cptune.parallel.backends.table`;
the local backend at context_parallel_size 1); these functions take it as an argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cptune.errors import CptuneError
from cptune.parallel.backends.attention import (
    ATTENTION_NAME,
    PACKED_MASKS_FROM_POSITION_IDS,
    check_attention_features,
    check_full_attention,
    register_attention,
    row_position_temperature,
    runs_samples_apart,
    stateful_layer_types,
    windowed_layer_types,
)
from cptune.parallel.backends.spec import BackendPlan, BackendPolicy
from cptune.parallel.layout import ParallelDims
from cptune.parallel.tensor_parallel import check_tensor_parallel_model

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe

__all__ = [
    "BackendPlan",
    "check_hidden_dropout",
    "check_model_config",
    "check_packing_layers",
    "check_packing_masks",
    "check_router_jitter",
    "plan_backend",
]


def plan_backend(
    backend: BackendPolicy, recipe: Recipe, dims: ParallelDims, pad_token_id: int, model_config: Any
) -> BackendPlan:
    """The backend's plan for this recipe, process layout and model config; imports its dependencies now."""
    plan = backend.runtime().plan(recipe, dims, pad_token_id, model_config)
    if plan.attn_implementation == ATTENTION_NAME:
        register_attention()
    return plan


# Config keys of dropouts on hidden states (and GPT-2-style attention probabilities) in transformers'
# decoder models. Llama, Qwen2/3 and Mistral have none of them (only attention_dropout).
HIDDEN_DROPOUT_KEYS = (
    "hidden_dropout",
    "hidden_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "embedding_dropout",
    "residual_dropout",
    "activation_dropout",
    "ffn_dropout",
    "dropout",
)


def check_hidden_dropout(text_config: Any) -> None:
    """Refuse a model's own dropout under CP: its masks come from each rank's generator.

    torch's dropout draws masks element by element from the process's generator, so CP
    rank ``r`` would draw the bits rank 0 draws, not its slice of the masks a cp=1 run
    draws. LoRA dropout is made exact (:mod:`cptune.parallel.dropout`); a model's own
    dropout runs inside its code, where cptune cannot key it.

    Raises:
        CptuneError: the config enables one (checked before any weight is loaded).
    """
    for key in HIDDEN_DROPOUT_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            raise CptuneError(
                f"base_model: its config sets {key}: {value}, a dropout inside the model whose masks cptune "
                "cannot split exactly across context-parallel ranks (each rank would draw its own instead of "
                f"its slice of the cp=1 masks). Set {key} to 0 in the model's config.json (fine-tunes rarely "
                "use it; lora_dropout is exact under CP), or use context_parallel_size: 1."
            )


def check_router_jitter(cp_size: int, config: Any) -> None:
    """Refuse router jitter (Mixtral's ``router_jitter_noise``) under context parallelism, before loading.

    transformers multiplies the router's input by noise drawn from each process's random generator
    (``uniform_`` over the process's own tokens, 5.23 modeling_mixtral.py), so a process holding a
    slice of a row draws other noise for its tokens than the run without CP draws.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    jitter = float(getattr(text, "router_jitter_noise", 0.0) or 0.0)
    if cp_size > 1 and jitter > 0.0:
        raise CptuneError(
            f"overrides_of_model_config: the model's router_jitter_noise is {jitter}: its router noise is drawn "
            "per process, so a context-parallel run would draw other noise for each token than the run at "
            "context_parallel_size: 1. Set router_jitter_noise: 0.0 in overrides_of_model_config, or train "
            "at context_parallel_size: 1."
        )


def check_packing_layers(recipe: Recipe, text_config: Any) -> None:
    """Refuse sample packing for a model whose layers would not see each packed sample as it is alone.

    Packed samples are kept apart by ``position_ids`` restarting at each sample: attention layers turn them
    into a mask (or cptune's attention into document bounds). Two things escape that. transformers runs a
    linear-attention, Mamba or convolution layer over the whole packed row, so each sample would start from
    the state the samples before it left (on a two-layer Qwen3.5 the second sample's logits move by 6e-3,
    tests/models/test_packed_models.py). And Llama 4 scales its NoPE layers' queries by the token's place
    in the row (:func:`row_position_temperature`), which differs from its place in its sample once rows
    reach ``floor_scale`` tokens.
    """
    if not recipe.sample_packing:
        return
    model = getattr(text_config, "model_type", None) or type(text_config).__name__
    floor = row_position_temperature(text_config)
    if floor is not None and recipe.sequence_len >= floor:
        raise CptuneError(
            f"sample_packing: base_model {model} scales the queries of its layers without rotary embeddings by "
            f"each token's place in the row, in steps of floor_scale: {floor} tokens (attn_temperature_tuning), "
            f"not by its place in its sample, so with sequence_len: {recipe.sequence_len} a sample packed after "
            f"others would be scaled unlike the same sample alone. Set sample_packing: false, a sequence_len "
            f"below {floor}, or attn_temperature_tuning: false in overrides_of_model_config."
        )
    kinds = stateful_layer_types(text_config)
    if kinds and not runs_samples_apart(text_config):
        raise CptuneError(
            f"sample_packing: base_model {model} has layers of type {kinds}, which carry a state from each "
            "token to the next across a whole row (linear attention, state-space or convolution layers); "
            "transformers does not restart them at each packed sample, so every sample would be trained on "
            "the ones packed before it. Set sample_packing: false (one sample per row, padded), or use a "
            "model with attention layers only."
        )


def check_stateful_layers_unsplit(text_config: Any) -> None:
    """Refuse context parallelism for a model with layers that carry a state along the sequence.

    A linear-attention, Mamba or convolution layer reads each token with the state the tokens before it
    left. Context parallelism gives each rank a part of the row; cptune passes no such state from one
    rank's part to the next, so every part after the first would start from nothing. (Attention needs no
    state: the ranks exchange keys and values instead.)
    """
    kinds = stateful_layer_types(text_config)
    if kinds:
        model = getattr(text_config, "model_type", None) or type(text_config).__name__
        raise CptuneError(
            f"context_parallel_size: base_model {model} has layers of type {kinds}, which carry a state from "
            "each token to the next (linear attention, state-space or convolution layers). Context parallelism "
            "splits each row between the ranks, and cptune does not pass that state from one rank's part of the "
            "row to the next, so every part but the first would start from nothing. Use context_parallel_size: "
            "1, or a model with attention layers only."
        )


def check_packing_masks(recipe: Recipe, config: Any, model_class: type | None) -> None:
    """Refuse sample packing at cp=1 for a model whose attention transformers' masks would not split by sample.

    Two cases: a model class without the ``AttentionInterface`` (below), and a model with sliding-window or
    other non-full layers, which cptune leaves to transformers' masks at cp=1 (:func:`.local.runtime.attends_by_document`)
    unless its type is one checked to build them from ``position_ids``
    (:data:`~cptune.parallel.backends.attention.PACKED_MASKS_FROM_POSITION_IDS`; afmoe does not).

    A model that routes its attention through transformers' ``AttentionInterface`` builds its masks with
    ``masking_utils``, which turns ``position_ids`` restarting at each sample into a mask per sample (or
    cptune's document attention replaces it). The older models that do not (Bloom, Falcon, MPT) build their
    own causal masks over the whole row: their packed samples attend to each other (a sample packed after 6
    tokens of another: its logits move by 3e-3 on a tiny Bloom, 0.2 on a tiny Falcon). The check is by class:
    GPT-J, whose own masks do read position_ids, is refused too; Qwen3.5 and Qwen3-Next, whose masks do and
    whose linear-attention layers cptune runs per sample, are not. A model class cptune cannot see (remote
    code) is not checked.
    """
    text_config = config.get_text_config()
    if not recipe.sample_packing or model_class is None or runs_samples_apart(text_config):
        return
    if not getattr(model_class, "_supports_attention_backend", False):
        raise CptuneError(
            f"sample_packing: base_model {model_class.__name__} does not route its attention through "
            "transformers' AttentionInterface, so neither cptune's attention nor transformers' masks from "
            "position_ids keep its packed samples apart: every packed sample would be trained on the ones "
            "packed before it. Set sample_packing: false (one sample per row, padded), or use a model that "
            "does (e.g. Llama, Qwen2/3, Mistral, Gemma 3)."
        )
    from cptune.parallel.backends.local.runtime import attends_by_document

    kinds = windowed_layer_types(text_config)
    model = getattr(text_config, "model_type", None)
    if kinds and not attends_by_document(recipe, config) and model not in PACKED_MASKS_FROM_POSITION_IDS:
        raise CptuneError(
            f"sample_packing: base_model {model} has attention layers of type {kinds}, which at "
            "context_parallel_size: 1 transformers computes with masks of its own, and cptune has not checked "
            f"that transformers' code for {model} builds them from position_ids (where each packed sample "
            "begins): its packed samples could attend to each other. Set sample_packing: false (one sample "
            "per row, padded); for sliding windows, context_parallel_size: 2 or more with cp_backend: "
            "ring-flash-attn (ring_attn_func: varlen_llama3) also keeps the samples apart, in cptune's attention."
        )


def check_model_config(
    backend: BackendPolicy, recipe: Recipe, dims: ParallelDims, config: Any, model_class: type | None
) -> None:
    """Refuse a model whose attention ``backend`` (the one of this layout) cannot split (before loading weights)."""
    text = config.get_text_config()
    check_tensor_parallel_model(config, model_class, dims.tp_size)
    if dims.cp_enabled:  # before packing's refusal, whose remedy (sample_packing: false) would not do
        check_stateful_layers_unsplit(text)
    check_packing_layers(recipe, text)
    if not dims.cp_enabled and recipe.causal:
        # transformers' sdpa runs, or cptune's document attention where the model's config showed it can
        # serve it (local.runtime.attends_by_document): only packing needs transformers' masks
        check_packing_masks(recipe, config, model_class)
        return
    computed_by = backend.label  # what computes the attention, for the messages
    # What avoids cptune's attention: cp=1, and causal: true where bidirectional attention brings it in.
    fallback = "context_parallel_size: 1" if recipe.causal else "context_parallel_size: 1 with causal: true"
    if backend.uses_cptune_attention(recipe):
        # At cp > 1 the backend's check_model refuses the attention sinks it cannot apply; at cp=1 cptune's
        # attention (bidirectional) has none.
        check_attention_features(text, computed_by, applies_sinks=dims.cp_enabled)
    if backend.attends_whole_layers:
        check_full_attention(text, computed_by)
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        need = (
            "its attention cannot be split across context-parallel ranks"
            if dims.cp_enabled
            else "cptune cannot give it bidirectional attention (causal: false)"
        )
        raise CptuneError(
            f"base_model: {model_class.__name__} does not route its attention through transformers' "
            f"AttentionInterface, so {need}. Use a model that does (e.g. Llama, Qwen2/3, Mistral), "
            f"or {fallback}."
        )
    dropout = getattr(text, "attention_dropout", 0.0) or 0.0
    if dropout and backend.uses_cptune_attention(recipe):
        # Checked here, not only in the attention function, where it would surface at the first step.
        raise CptuneError(
            f"base_model: its config sets attention_dropout: {dropout}, but {computed_by} computes "
            "attention without dropout (cptune's attention does not support attention dropout). Set "
            f"attention_dropout to 0 in the model's config.json, or use {fallback}."
        )
    if not dims.cp_enabled:
        return
    check_hidden_dropout(text)
    check_router_jitter(dims.cp_size, text)
    backend.check_model(recipe, dims.cp_size, text)
