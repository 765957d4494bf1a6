"""cptune's attention function for transformers' ``AttentionInterface``.

Models route attention through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.
cptune registers one function under its own name (never overwriting
``flash_attention_2`` or ``sdpa``). It does no work itself: every forward call
carries an :class:`AttentionCall` in the keyword ``cp_attention`` (invariant 6:
per-batch metadata travels with the call, not in module globals), and the
function hands query, key and value to it. The call also counts the attention
layers it served, so a model whose attention bypasses the backend is caught
instead of silently computing shard-local attention.

Sliding-window layers: transformers' models pass each layer's window as the keyword
``sliding_window`` (the number of keys a query sees, itself included: key ``k`` is in the
window of query ``q`` when ``0 <= q - k < sliding_window``, ``masking_utils.sliding_window_overlay``),
``None`` on full-attention layers. The function hands it on as ``window`` to a call whose backend
attends windows over the whole sequence (``takes_window``) and refuses it otherwise; the call counts
the windowed layers it served, so a model whose windowed layers do not pass their window is caught too.

Attention sinks: gpt-oss passes each layer's learned per-head sink logits as the keyword ``s_aux``. The
function hands them on as ``sinks`` to a call whose backend applies them once to each query's merged
attention (``takes_sinks``, :mod:`cptune.parallel.kernels.sinks`) and refuses them otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface

from cptune.errors import CptuneError

ATTENTION_NAME = "cptune"
ATTENTION_KWARG = "cp_attention"

# attend(query, key, value, softmax_scale) with tensors laid out (batch, tokens, heads, head_dim)
# returns the attention output in the same layout; a call that ``takes_window`` also gets the
# keyword ``window`` (transformers' ``sliding_window``) on windowed layers, and one that ``takes_sinks``
# the keyword ``sinks`` (the layer's ``(heads,)`` sink logits) on layers with attention sinks.
Attend = Callable[..., torch.Tensor]

SLIDING_ATTENTION = "sliding_attention"
"""transformers' ``layer_types`` entry of a sliding-window layer (the one non-full kind cptune attends)."""


class AttentionCall:
    """What one forward pass needs to compute attention over the full sequence.

    Deliberately not a dataclass: wrappers that map over a forward's keyword
    arguments (FSDP2's input casting under mixed precision, through
    ``torch.distributed.utils._apply_to_tensors``) rebuild dataclasses with
    ``dataclasses.replace``, and the attention layers would then count their calls
    on a copy the trainer never sees. Objects of other classes pass through as
    they are.
    """

    __slots__ = (
        "attend",
        "layers_served",
        "sink_layers_served",
        "takes_sinks",
        "takes_window",
        "windowed_layers_served",
    )

    def __init__(self, attend: Attend, *, takes_window: bool = False, takes_sinks: bool = False) -> None:
        self.attend = attend
        #: ``attend`` takes ``window=`` and counts it in positions of the whole sequence, within documents
        self.takes_window = takes_window
        #: ``attend`` takes ``sinks=`` and puts them once into each query's softmax over all of its keys
        self.takes_sinks = takes_sinks
        self.layers_served = 0
        self.windowed_layers_served = 0
        self.sink_layers_served = 0


def cptune_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention through the batch's :class:`AttentionCall`; inputs (batch, heads, tokens, head_dim)."""
    call = kwargs.get(ATTENTION_KWARG)
    if not isinstance(call, AttentionCall):
        raise CptuneError(
            "this model is set up for cptune's context-parallel attention, which needs per-batch "
            "metadata; call it through cptune's trainer (generation is not supported on such a model)."
        )
    if attention_mask is not None:
        raise CptuneError(
            "cptune's attention received an attention mask it would have to ignore; documents are "
            "delimited by position_ids instead. This is a bug in cptune's batching: please report it."
        )
    if dropout:
        raise CptuneError(
            "base_model: cptune's attention does not support attention dropout (the model asked for "
            f"{dropout}); set attention_dropout to 0 in the model's config.json."
        )
    check_attention_extras(kwargs)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    extras: dict[str, Any] = {}
    sinks = take_sinks(call, kwargs)
    if sinks is not None:
        extras["sinks"] = sinks
    if sliding_window is None:
        out = call.attend(q, k, v, scaling, **extras)
    else:
        check_window_taken(call, sliding_window)
        out = call.attend(q, k, v, scaling, window=int(sliding_window), **extras)
        call.windowed_layers_served += 1
    call.layers_served += 1
    return out, None


# transformers model types whose attention adds learned per-head sink logits to the softmax (``s_aux``).
MODELS_WITH_SINKS = ("gpt_oss",)


def check_attention_features(config: Any, computed_by: str, *, applies_sinks: bool = False) -> None:
    """Refuse, before loading, attention features cptune's attention would drop: logit soft-capping, sinks.

    Args:
        config: The model's (text) config.
        computed_by: Who computes the attention, for the message (e.g. ``cp_backend: torch``).
        applies_sinks: ``computed_by`` applies attention sinks (its backend checks them itself).
    """
    model = getattr(config, "model_type", None) or type(config).__name__
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        raise CptuneError(
            f"base_model: {model} soft-caps its attention logits (attn_logit_softcapping: {softcap}), which "
            f"{computed_by} does not (cptune's kernels have no soft-capping). Use context_parallel_size: 1 "
            "with causal: true, or a model without it (Gemma 3 instead of Gemma 2)."
        )
    if not applies_sinks:
        refuse_sinks(
            config,
            computed_by,
            "it has no place for a logit outside the keys",
            "Use context_parallel_size: 1 with causal: true.",
        )


def has_sinks(config: Any) -> bool:
    """Whether ``config``'s attention layers add learned sink logits to their softmax (gpt-oss)."""
    return getattr(config, "model_type", None) in MODELS_WITH_SINKS


def refuse_sinks(config: Any, computed_by: str, reason: str, remedy: str) -> None:
    """Raise if ``config``'s attention has sink logits, naming the model, its layer types and the backend.

    Args:
        config: The model's (text) config.
        computed_by: Who computes the attention, for the message (e.g. ``cp_backend: torch``).
        reason: Why ``computed_by`` cannot apply them exactly.
        remedy: What the user can do instead.
    """
    if has_sinks(config):
        model = getattr(config, "model_type", None)
        kinds = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
        raise CptuneError(
            f"base_model: {model} adds a learned sink logit per head to the softmax of its attention layers "
            f"(of type {kinds}), which {computed_by} cannot apply exactly: {reason}. {remedy} "
            "(cp_backend: ring-flash-attn, with ring_attn_func varlen_llama3 or batch_zigzag, and cp_backend: "
            "deepspeed with ulysses_attn_implementation: cptune, apply them.)"
        )


def check_attention_extras(kwargs: dict[str, Any]) -> None:
    """Refuse attention features the model asks for that cptune's attention would drop (soft-capping)."""
    softcap = kwargs.get("softcap")
    if softcap:
        raise CptuneError(
            f"base_model: its attention soft-caps the attention logits (attn_logit_softcapping: {softcap}), which "
            "cptune's context-parallel attention does not; use a model without it, or context_parallel_size: 1."
        )


def take_sinks(call: AttentionCall, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The layer's sink logits (gpt-oss's ``s_aux``, one per query head), or None when it has none.

    Raises:
        CptuneError: the layer has them and ``call``'s backend does not apply them (the model checks
            should have refused the model before loading).
    """
    sinks = kwargs.get("s_aux")
    if sinks is None:
        return None
    if not call.takes_sinks:
        raise CptuneError(
            "an attention layer with learned sink logits (s_aux, as gpt-oss) reached a context-parallel "
            "attention that does not apply them; this model should have been refused before loading. This is "
            "a bug in cptune's model checks: please report it, and use context_parallel_size: 1 meanwhile."
        )
    call.sink_layers_served += 1
    return sinks


def check_window_taken(call: AttentionCall, sliding_window: int) -> None:
    """Raise unless ``call``'s backend attends a window of ``sliding_window`` keys (the model checks missed it)."""
    if not call.takes_window:
        raise CptuneError(
            f"a sliding-window layer (sliding_window: {sliding_window}) reached a context-parallel attention "
            "that computes full attention; this model should have been refused before loading. This is a bug "
            "in cptune's model checks: please report it, and use context_parallel_size: 1 meanwhile."
        )


def sdpa_tokens_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """PyTorch SDPA on (batch, tokens, heads, head_dim) tensors, grouped-query heads included."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def windowed_layer_types(config: Any) -> list[str]:
    """The kinds of attention layers in ``config`` other than full attention (e.g. sliding windows)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return sorted({kind for kind in layer_types if kind != "full_attention"})
    # Models that predate layer_types (Mistral) window every layer when sliding_window is set.
    return [SLIDING_ATTENTION] if getattr(config, "sliding_window", None) else []


# layer_types entries of layers that mix no tokens (NemotronH's MLP and mixture-of-experts layers, and the
# dense/sparse MLP kinds some configs list).
_NON_MIXING_LAYER_TYPES = frozenset({"mlp", "moe", "dense", "sparse"})


def stateful_layer_types(config: Any) -> list[str]:
    """The kinds of ``config``'s layers that mix tokens other than by attention.

    A kind in ``layer_types`` is taken to attend when its name ends in ``attention`` (full, sliding,
    chunked...), except ``linear_attention``, transformers' name for recurrent layers (Qwen3-Next's and
    Qwen3.5's gated delta rule, Mamba); a kind that mixes no tokens (``mlp``, ``moe``) is left out. The
    rest (``linear_attention``, ``hybrid``: attention beside a Mamba mixer in Falcon-H1 and Zamba2,
    ``conv``: LFM2's short convolutions, and kinds cptune does not know) carry a state from each token
    to the next that no attention mask or ``position_ids`` restarts.
    """
    kinds = set(getattr(config, "layer_types", None) or ())
    return sorted(
        kind
        for kind in kinds
        if (kind == "linear_attention" or not kind.endswith("attention"))
        and kind not in _NON_MIXING_LAYER_TYPES
    )


PACKED_MASKS_FROM_POSITION_IDS = frozenset(
    {
        "beam",
        "cohere2",
        "cohere2_moe",
        "cwm",
        "exaone4",
        "exaone_moe",
        "flint",
        "gemma2",
        "gemma3_text",
        "gemma3n_text",
        "gemma4_text",
        "granite_swa",
        "granitemoe_swa",
        "kolibri1",
        "llama4_text",
        "mimo_v2_flash",
        "ministral",
        "mistral",
        "mixtral",
        "olmo3",
        "phi3",
        "qwen2",
        "starcoder2",
        "vaultgemma",
    }
)
"""transformers model types (of the text config) with sliding-window or chunked layers whose code (transformers
5.23) builds its attention masks from ``position_ids``, so that a packed row through transformers' own attention
keeps its samples apart: cptune leaves such layers to transformers at context_parallel_size 1 (``sdpa``, or
``eager`` for Gemma 2 and the others without an sdpa path). Each is checked on a tiny model
(tests/models/test_packed_models.py); afmoe, for one, builds its masks without ``position_ids``."""

PER_SAMPLE_RECURRENCE = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
"""transformers model types (of the text config) whose linear-attention layers cptune runs sample by sample on
packed rows (:mod:`cptune.models.document_recurrence`); their full-attention layers build their masks from
``position_ids`` (``masking_utils``), though their classes do not use the ``AttentionInterface``."""


def runs_samples_apart(config: Any) -> bool:
    """Whether cptune runs every layer of ``config`` (a text config) on each packed sample as on the sample alone
    although some carry a state from token to token: Qwen3.5 and Qwen3-Next, full and linear attention only."""
    kinds = set(getattr(config, "layer_types", None) or ())
    return getattr(config, "model_type", None) in PER_SAMPLE_RECURRENCE and kinds <= {
        "full_attention",
        "linear_attention",
    }


def row_position_temperature(config: Any) -> int | None:
    """``floor_scale`` where ``config``'s layers without rotary embeddings scale their queries by the token's place.

    Llama 4's ``attn_temperature_tuning`` multiplies the queries of its NoPE layers (``no_rope_layers`` entry 0)
    by ``1 + attn_scale * log1p(floor((i + 1) / floor_scale))``, where ``i`` counts the tokens of the whole row
    (transformers 5.23, ``Llama4TextAttention``), not of the sample: a sample packed at an offset, or a slice
    of a row on a context-parallel rank, is scaled as it would not be alone. None where nothing is scaled.
    """
    if not getattr(config, "attn_temperature_tuning", False):
        return None
    if 0 not in (getattr(config, "no_rope_layers", None) or ()):
        return None
    return int(getattr(config, "floor_scale", 0)) or None


def count_windowed_layers(config: Any) -> int:
    """How many of ``config``'s attention layers are sliding-window layers (what a forward must pass a window)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return sum(kind == SLIDING_ATTENTION for kind in layer_types)
    return int(config.num_hidden_layers) if getattr(config, "sliding_window", None) else 0


def refuse_windowed_layers(config: Any, computed_by: str, reason: str, remedy: str) -> None:
    """Raise if ``config`` has non-full attention layers, naming the model, their kind and the backend.

    Args:
        config: The model's (text) config.
        computed_by: Who computes the attention, for the message (e.g. ``cp_backend: torch``).
        reason: Why ``computed_by`` cannot attend them exactly.
        remedy: What the user can do instead.
    """
    limited = windowed_layer_types(config)
    if limited:
        model = getattr(config, "model_type", None) or type(config).__name__
        raise CptuneError(
            f"base_model: {model} has attention layers of type {limited} (sliding_window: "
            f"{getattr(config, 'sliding_window', None)}), which {computed_by} cannot compute exactly: {reason}. "
            f"{remedy}"
        )


def check_full_attention(config: Any, computed_by: str) -> None:
    """Refuse a model with sliding-window (or other non-full) attention layers.

    For attention that computes full (causal or bidirectional) attention over the whole row and
    never sees a window, so such layers would silently attend to too much.

    Args:
        config: The model's (text) config.
        computed_by: Who computes the attention, for the message (e.g. ``cp_backend: torch``).
    """
    refuse_windowed_layers(
        config,
        computed_by,
        "it computes full (causal or bidirectional) attention over the whole row, so those layers would "
        "silently see too much",
        "Use cp_backend: ring-flash-attn (ring_attn_func: varlen_llama3) or cp_backend: deepspeed with "
        "causal: true, a model with full attention only, or context_parallel_size: 1 with causal: true.",
    )


def check_window_support(config: Any, computed_by: str, *, causal: bool) -> None:
    """Refuse what a backend that attends sliding windows (causal, within documents) still cannot do.

    Such a backend takes transformers' ``sliding_window`` per layer; it refuses other non-full kinds
    (chunked attention) and bidirectional windows, which transformers defines two ways (``|q - k| <=
    sliding_window`` in masking_utils' bidirectional masks, ``< sliding_window`` in its flash-attention
    path, ``window_size=(w - 1, w - 1)``, and in Gemma 3's ``use_bidirectional_attention``).
    """
    kinds = windowed_layer_types(config)
    other = [kind for kind in kinds if kind != SLIDING_ATTENTION]
    if other:
        refuse_windowed_layers(
            config,
            computed_by,
            f"it attends sliding windows only, not {other}",
            "Use a model with full or sliding-window attention, or context_parallel_size: 1 with causal: true.",
        )
    if kinds and not causal:
        refuse_windowed_layers(
            config,
            computed_by,
            "its sliding windows are causal only: transformers 5.23 defines no single bidirectional window "
            "(its sdpa and eager masks keep the keys up to sliding_window positions away on either side, "
            "masking_utils.sliding_window_bidirectional_overlay; its flash-attention path and Gemma 3's "
            "use_bidirectional_attention keep those less than sliding_window away), so there is no run without "
            "context parallelism for a window to be exact to",
            "Use causal: true, or context_parallel_size: 1 with causal: true.",
        )


def register_attention() -> str:
    """Register cptune's attention function (idempotent) and return its name."""
    AttentionInterface.register(ATTENTION_NAME, cptune_attention_forward)
    return ATTENTION_NAME


def count_attention_layers(model: torch.nn.Module) -> int:
    """Number of attention layers a forward pass of ``model`` must run."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text_config, "num_hidden_layers", None)
    if not layers:
        raise CptuneError("cannot tell how many attention layers this model has (no num_hidden_layers).")
    return int(layers)


def check_layers_served(call: AttentionCall, expected: int, windowed: int | None = None) -> None:
    """Raise unless every attention layer of the forward pass went through ``call``.

    Args:
        call: The forward pass's call.
        expected: Its attention layers (:func:`count_attention_layers`).
        windowed: Its sliding-window layers (:func:`count_windowed_layers`), each of which must have
            passed its window; None skips that check.
    """
    if call.layers_served != expected:
        raise CptuneError(
            f"the model ran {call.layers_served} of its {expected} attention layers through cptune's "
            "context-parallel attention; the others would attend only within this rank's shard and give "
            "wrong results. This model's attention cannot be routed through the CP backend: use a model "
            "whose attention goes through transformers' AttentionInterface (e.g. Llama, Qwen, Mistral), "
            "or context_parallel_size: 1."
        )
    if windowed is not None and call.windowed_layers_served != windowed:
        raise CptuneError(
            f"the model passed a sliding window to cptune's context-parallel attention in "
            f"{call.windowed_layers_served} of its {windowed} sliding-window layers; the others would attend "
            "over the whole sequence. This model's windows cannot be routed through the CP backend: use "
            "context_parallel_size: 1."
        )
