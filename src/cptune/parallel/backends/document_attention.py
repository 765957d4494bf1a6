"""cptune's document-aware core attention for DeepSpeed's Ulysses (``ulysses_attn_implementation: cptune``).

DeepSpeed's Ulysses wrapper drops the attention mask, so packed documents would attend to each
other through SDPA. This core attention reads the documents from the call's ``position_ids``
instead and attends each within itself: one varlen FlashAttention-2 call over all of them on GPUs
(:mod:`cptune.parallel.kernels.varlen`), one SDPA call per document elsewhere. Under Ulysses every
rank holds whole rows (for its heads), so a sliding-window layer's window (transformers'
``sliding_window``, causal) counts positions of the whole sequence, within each document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from cptune.errors import CptuneError
from cptune.labels import document_starts
from cptune.parallel.backends.attention import (
    ATTENTION_KWARG,
    AttentionCall,
    check_attention_extras,
    check_window_taken,
    sdpa_tokens_first,
)
from cptune.parallel.shard import cu_seqlens_from_starts

DOCUMENT_ATTENTION_NAME = "cptune_documents"
"""transformers attention name of cptune's document-aware core attention (recipe value ``cptune``)."""


def document_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each document of one row, from its positions (see ``tokens.document_starts``)."""
    begins = torch.nonzero(document_starts(position_ids), as_tuple=False).flatten().tolist()
    return list(zip(begins, [*begins[1:], position_ids.shape[-1]], strict=True))


@dataclass(frozen=True)
class DocumentAttention:
    """Exact attention within each document of the whole sequence, (batch, tokens, heads, head_dim) in and out.

    Where PyTorch's FlashAttention-2 takes the tensors (CUDA, bf16/fp16) every document of every
    row goes through one varlen call; elsewhere each document is one SDPA call, so memory grows
    with the longest document, not the row.
    """

    causal: bool

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None,
        window: int | None = None,
    ) -> torch.Tensor:
        """One document, (1, tokens, heads, head_dim); ``window``: a query sees its last ``window`` keys."""
        if window is None:
            return sdpa_tokens_first(q, k, v, scale, is_causal=self.causal)
        return sdpa_tokens_first(q, k, v, scale, attn_mask=window_mask(q.shape[1], window, q.device))

    def rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None,
        position_ids: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """Every row, its documents delimited by ``position_ids`` ((1 or batch, tokens)); ``window`` as in
        ``__call__`` (causal only)."""
        from cptune.parallel.kernels import torch_flash

        if window is not None and not self.causal:
            raise CptuneError(
                "cptune's Ulysses attention got a sliding window with causal: false; bidirectional windows "
                "should have been refused before loading. This is a bug in cptune's model checks: please report it."
            )
        positions = position_ids.expand(q.shape[0], -1)
        if torch_flash.runs(q):
            from cptune.parallel.kernels.varlen import varlen_attention

            # Every row starts a document, so the rows laid end to end are one packed sequence.
            cu_seqlens = cu_seqlens_from_starts(document_starts(positions).flatten())
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            out = varlen_attention(
                *(t.flatten(0, 1) for t in (q, k, v)),
                cu_seqlens,
                max_seqlen,
                scale=scale,
                causal=self.causal,
                window=window,
            )
            return out.unflatten(0, q.shape[:2])
        rows = []
        for b in range(q.shape[0]):
            pieces = [
                self(q[b : b + 1, s:e], k[b : b + 1, s:e], v[b : b + 1, s:e], scale, window)
                for s, e in document_spans(positions[b])
            ]
            rows.append(torch.cat(pieces, dim=1))
        return torch.cat(rows)


def window_mask(tokens: int, window: int, device: torch.device) -> torch.Tensor:
    """(tokens, tokens) boolean mask of causal sliding-window attention: ``0 <= q - k < window``."""
    index = torch.arange(tokens, device=device)
    distance = index[:, None] - index[None, :]
    return (distance >= 0) & (distance < window)


def dense_attend(causal: bool) -> DocumentAttention:
    """The core attention of :class:`DeepSpeedUlyssesBackend` (``ulysses_attn_implementation: cptune``)."""
    return DocumentAttention(causal)


def document_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each document of the whole sequence; inputs (batch, heads, tokens, head_dim).

    Under Ulysses this runs after the all-to-all, where DeepSpeed's wrapper has
    replaced ``position_ids`` in the call's keywords by those of the whole
    sequence (ulysses_sp.py:294-296); in evaluation it runs on whole rows. Either
    way the documents come from the call itself (invariant 6); the call's
    :class:`DocumentAttention` attends them.
    """
    call = kwargs.get(ATTENTION_KWARG)
    position_ids = kwargs.get("position_ids")
    if (
        not isinstance(call, AttentionCall)
        or not isinstance(call.attend, DocumentAttention)
        or position_ids is None
    ):
        raise CptuneError(
            "this model is set up for cptune's Ulysses attention, which needs the batch's position_ids and "
            "per-batch metadata; call it through cptune's trainer (generation is not supported on such a model)."
        )
    if attention_mask is not None or position_ids.shape[-1] != query.shape[2]:
        raise CptuneError(
            "cptune's Ulysses attention received an attention mask, or position_ids that do not cover the "
            "sequence it attends over. This is a bug in cptune's batching: please report it."
        )
    if dropout:
        raise CptuneError(
            "base_model: cptune's attention does not support attention dropout (the model asked for "
            f"{dropout}); set attention_dropout to 0 in the model's config.json."
        )
    check_attention_extras(kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if sliding_window is None:
        out = call.attend.rows(q, k, v, scaling, position_ids)
    else:
        check_window_taken(call, sliding_window)
        out = call.attend.rows(q, k, v, scaling, position_ids, window=int(sliding_window))
        call.windowed_layers_served += 1
    call.layers_served += 1
    return out, None


def register_document_attention() -> str:
    """Register cptune's document-aware core attention (idempotent) and return its name."""
    AttentionInterface.register(DOCUMENT_ATTENTION_NAME, document_attention_forward)
    return DOCUMENT_ATTENTION_NAME
