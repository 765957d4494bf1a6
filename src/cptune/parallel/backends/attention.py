"""cptune's attention function for transformers' ``AttentionInterface``.

Models route attention through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.
cptune registers one function under its own name (never overwriting
``flash_attention_2`` or ``sdpa``). It does no work itself: every forward call
carries an :class:`AttentionCall` in the keyword ``cp_attention`` (invariant 6:
per-batch metadata travels with the call, not in module globals), and the
function hands query, key and value to it. The call also counts the attention
layers it served, so a model whose attention bypasses the backend is caught
instead of silently computing shard-local attention.
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
# returns the attention output in the same layout.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]


class AttentionCall:
    """What one forward pass needs to compute attention over the full sequence.

    Deliberately not a dataclass: wrappers that map over a forward's keyword
    arguments (FSDP2's input casting under mixed precision, through
    ``torch.distributed.utils._apply_to_tensors``) rebuild dataclasses with
    ``dataclasses.replace``, and the attention layers would then count their calls
    on a copy the trainer never sees. Objects of other classes pass through as
    they are.
    """

    __slots__ = ("attend", "layers_served")

    def __init__(self, attend: Attend) -> None:
        self.attend = attend
        self.layers_served = 0


def cptune_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
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
    out = call.attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling)
    call.layers_served += 1
    return out, None


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
    return ["sliding_attention"] if getattr(config, "sliding_window", None) else []


def check_full_attention(config: Any, computed_by: str) -> None:
    """Refuse a model with sliding-window (or other non-full) attention layers.

    cptune's attention computes full (causal or bidirectional) attention over the whole row and
    never sees a window, so such layers would silently attend to too much.

    Args:
        config: The model's (text) config.
        computed_by: Who computes the attention, for the message (e.g. ``cp_backend: torch``).
    """
    limited = windowed_layer_types(config)
    if limited:
        raise CptuneError(
            f"base_model: has attention layers of type {limited}, but {computed_by} computes full "
            "(causal or bidirectional) attention over the whole row, so those layers would silently see "
            "too much. Use a model with full attention only, or context_parallel_size: 1 with causal: true."
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


def check_layers_served(call: AttentionCall, expected: int) -> None:
    """Raise unless every attention layer of the forward pass went through ``call``."""
    if call.layers_served != expected:
        raise CptuneError(
            f"the model ran {call.layers_served} of its {expected} attention layers through cptune's "
            "context-parallel attention; the others would attend only within this rank's shard and give "
            "wrong results. This model's attention cannot be routed through the CP backend: use a model "
            "whose attention goes through transformers' AttentionInterface (e.g. Llama, Qwen, Mistral), "
            "or context_parallel_size: 1."
        )
