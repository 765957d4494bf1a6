"""cptune's document-aware attention: DeepSpeed's Ulysses core attention (``ulysses_attn_implementation:
cptune``) and the cp=1 path (``LocalBackend(documents=True)``).

DeepSpeed's Ulysses wrapper drops the attention mask, so packed documents would attend to each
other through SDPA. This core attention reads the documents from the call's ``position_ids``
instead and attends each within itself: one varlen FlashAttention-2 call over all of them on GPUs
(:mod:`cptune.parallel.kernels.varlen`), one SDPA call per document elsewhere. At cp=1 it spares
the ``tokens x tokens`` mask transformers' sdpa would build for a packed row. Under Ulysses every
rank holds whole rows (for its heads), so a sliding-window layer's window (transformers'
``sliding_window``, causal) counts positions of the whole sequence, within each document, and a
layer's attention sinks (gpt-oss's ``s_aux``) go into each query's softmax over all of its keys
(one varlen call, on the CPU stand-ins off GPUs: :mod:`cptune.parallel.kernels.sinks`).
"""

from __future__ import annotations

import itertools
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
    take_sinks,
)
from cptune.parallel.shard import cu_seqlens_from_starts

DOCUMENT_ATTENTION_NAME = "cptune_documents"
"""transformers attention name of cptune's document-aware core attention (recipe value ``cptune``)."""


def document_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each document of one row, from its positions (see ``tokens.document_starts``)."""
    begins = torch.nonzero(document_starts(position_ids), as_tuple=False).flatten().tolist()
    return list(zip(begins, [*begins[1:], position_ids.shape[-1]], strict=True))


@dataclass(frozen=True)
class RowDocuments:
    """Where the documents of a batch's rows lie, worked out once per batch rather than once per layer.

    ``cu_seqlens`` and ``max_seqlen`` describe the rows laid end to end (every row starts a document,
    so they form one packed sequence) for the varlen kernel; ``lengths`` gives each row's document
    lengths for the per-document calls elsewhere.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    lengths: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, position_ids: torch.Tensor, rows: int) -> RowDocuments:
        """The documents of ``rows`` rows whose positions are ``position_ids`` ((1 or rows, tokens))."""
        starts = document_starts(position_ids.expand(rows, -1))
        cu_seqlens = cu_seqlens_from_starts(starts.flatten())
        ends = cu_seqlens.tolist()  # one copy to the host per batch
        row_length = starts.shape[-1]
        lengths: list[list[int]] = [[] for _ in range(rows)]
        for begin, end in itertools.pairwise(ends):
            lengths[begin // row_length].append(end - begin)
        return cls(cu_seqlens, max(max(row) for row in lengths), tuple(map(tuple, lengths)))


@dataclass(frozen=True)
class DocumentAttention:
    """Exact attention within each document of the whole sequence, (batch, tokens, heads, head_dim) in and out.

    Where PyTorch's FlashAttention-2 takes the tensors (CUDA, bf16/fp16) every document of every
    row goes through one varlen call; elsewhere each document is one SDPA call, so memory grows
    with the longest document, not the row. No ``tokens x tokens`` mask is ever built.
    """

    causal: bool
    #: the recipe's attention_kv_heads_per_call (None: every head at once)
    kv_heads_per_call: int | None = None
    #: which block of the query heads this rank attends (its CP rank: DeepSpeed's all-to-all gives rank r
    #: the r-th block of H/C heads, ulysses_sp.py:185-190); selects those heads' sink logits
    head_block: int = 0

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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row, its documents delimited by ``position_ids`` ((1 or batch, tokens)); ``window`` as in
        ``__call__`` (causal only); ``sinks``: the layer's sink logits of every query head, or None."""
        if window is not None and not self.causal:
            raise CptuneError(
                "cptune's Ulysses attention got a sliding window with causal: false; bidirectional windows "
                "should have been refused before loading. This is a bug in cptune's model checks: please report it."
            )
        return self.within(q, k, v, scale, RowDocuments.of(position_ids, q.shape[0]), window, sinks)

    def within(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None,
        documents: RowDocuments,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row, its documents as ``documents`` says; ``window`` as in ``__call__``; ``sinks`` as in
        ``rows``."""
        if sinks is not None:
            heads = q.shape[2]
            sinks = sinks[self.head_block * heads : (self.head_block + 1) * heads]
        if sinks is None and window is None and all(len(row) == 1 for row in documents.lengths):
            # Rows of one document each (unpacked, unpadded): one SDPA call over the batch, as transformers'
            # sdpa runs them, so that such rows keep SDPA's kernels (cuDNN's on Hopper, measured faster than
            # FlashAttention-2: docs/benchmarks.md). A window would need a tokens x tokens mask there.
            return self(q, k, v, scale)
        if varlen_runs(q) or sinks is not None:
            # SDPA has no sink: the varlen kernels (the CPU stand-ins off GPUs) return the lse it goes into.
            from cptune.parallel.kernels.varlen import varlen_attention

            extras = {} if sinks is None else {"sinks": sinks}
            out = varlen_attention(
                *(t.flatten(0, 1) for t in (q, k, v)),
                documents.cu_seqlens,
                documents.max_seqlen,
                scale=scale,
                causal=self.causal,
                window=window,
                kv_heads_per_call=self.kv_heads_per_call,
                **extras,
            )
            return out.unflatten(0, q.shape[:2])
        rows = []
        for b, lengths in enumerate(documents.lengths):
            # split, not one slice per document: its backward concatenates the documents' gradients
            # instead of zero-filling a whole row for each of them.
            pieces = zip(*(t[b : b + 1].split(lengths, dim=1) for t in (q, k, v)), strict=True)
            rows.append(torch.cat([self(qd, kd, vd, scale, window) for qd, kd, vd in pieces], dim=1))
        return torch.cat(rows)


def varlen_runs(q: torch.Tensor) -> bool:
    """Whether :class:`DocumentAttention` takes ``q`` through one varlen FlashAttention-2 call."""
    from cptune.parallel.kernels import torch_flash

    return torch_flash.runs(q)


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
    sinks = take_sinks(call, kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if sliding_window is None:
        out = call.attend.rows(q, k, v, scaling, position_ids, sinks=sinks)
    else:
        check_window_taken(call, sliding_window)
        out = call.attend.rows(q, k, v, scaling, position_ids, window=int(sliding_window), sinks=sinks)
        call.windowed_layers_served += 1
    call.layers_served += 1
    return out, None


def register_document_attention() -> str:
    """Register cptune's document-aware core attention (idempotent) and return its name."""
    AttentionInterface.register(DOCUMENT_ATTENTION_NAME, document_attention_forward)
    return DOCUMENT_ATTENTION_NAME
