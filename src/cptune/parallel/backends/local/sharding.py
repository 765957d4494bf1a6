"""No context parallelism (cp=1): the reference path every CP backend must equal.

Two ways to attend over whole rows. With ``documents`` (what a run picks whenever the model
has full attention only, :mod:`.runtime`), cptune's attention function attends each document of
each row within itself (:class:`DocumentAttention`: one varlen FlashAttention-2 call on GPUs,
one SDPA call per document elsewhere), so no ``tokens x tokens`` mask is ever built. Without it,
causal training uses transformers' own ``sdpa`` path, which keeps packed documents apart from
their ``position_ids`` (with ``use_cache=False``) through a block-diagonal mask of
``rows x tokens x tokens`` booleans (256 GiB at 512K tokens), and bidirectional training uses
cptune's attention function with such a mask, since transformers builds none for decoder models.
"""

from __future__ import annotations

import torch

from cptune.labels import document_starts
from cptune.parallel.backends.attention import (
    ATTENTION_KWARG,
    ATTENTION_NAME,
    AttentionCall,
    sdpa_tokens_first,
)
from cptune.parallel.backends.base import SameBatchForEveryCpRank, ShardedInputs
from cptune.parallel.backends.document_attention import DocumentAttention, RowDocuments
from cptune.parallel.shard import TokenBatch, full_coords


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(rows, 1, tokens, tokens) boolean mask: True where query and key share a document."""
    doc_ids = document_starts(position_ids).cumsum(-1)
    return (doc_ids[:, :, None] == doc_ids[:, None, :]).unsqueeze(1)


class LocalBackend(SameBatchForEveryCpRank):
    """Single-rank attention over whole rows.

    Args:
        causal: Causal attention within each document; otherwise bidirectional.
        documents: Attend document by document (no ``tokens x tokens`` mask); otherwise through a mask.
        kv_heads_per_call: KV heads per FlashAttention-2 call of the document attention (None: all).
        transformers_attention: transformers' implementation for causal attention without ``documents``:
            ``sdpa``, or ``eager`` for a model without an sdpa path (Gemma 2 in transformers 5.23).
    """

    def __init__(
        self,
        causal: bool,
        *,
        documents: bool = False,
        kv_heads_per_call: int | None = None,
        transformers_attention: str = "sdpa",
    ):
        self.causal = causal
        self.documents = documents
        self.kv_heads_per_call = kv_heads_per_call
        self.uses_transformers_attention = causal and not documents
        self.attn_implementation = (
            transformers_attention if self.uses_transformers_attention else ATTENTION_NAME
        )

    def shard(self, batch: TokenBatch) -> ShardedInputs:
        kwargs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
        coords = full_coords(batch.shape, batch.input_ids.device)
        if self.uses_transformers_attention:
            return ShardedInputs(
                model_kwargs=kwargs, shift_labels=batch.shift_labels, call=None, coords=coords
            )
        if self.documents:
            attention = DocumentAttention(self.causal, self.kv_heads_per_call)
            documents = RowDocuments.of(batch.position_ids, batch.shape[0])

            def attend(q, k, v, scale, window=None, sinks=None):
                return attention.within(q, k, v, scale, documents, window, sinks)

        else:
            mask = document_mask(batch.position_ids)

            def attend(q, k, v, scale):
                return sdpa_tokens_first(q, k, v, scale, attn_mask=mask)

        # The document attention takes sliding windows (causal) and attention sinks (a model, gpt-oss, that
        # transformers' sdpa cannot run: runtime.attends_by_document).
        call = AttentionCall(
            attend=attend, takes_window=self.documents and self.causal, takes_sinks=self.documents
        )
        return ShardedInputs(
            model_kwargs={**kwargs, ATTENTION_KWARG: call},
            shift_labels=batch.shift_labels,
            call=call,
            coords=coords,
        )
