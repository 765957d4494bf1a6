"""No context parallelism (cp=1): the reference path every CP backend must equal.

Causal training uses transformers' own ``sdpa`` path, which keeps packed
documents apart from their ``position_ids`` (with ``use_cache=False``).
Bidirectional training uses cptune's attention function with a block-diagonal
document mask, since transformers builds no such mask for decoder models.
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
from cptune.parallel.shard import TokenBatch, full_coords


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(rows, 1, tokens, tokens) boolean mask: True where query and key share a document."""
    doc_ids = document_starts(position_ids).cumsum(-1)
    return (doc_ids[:, :, None] == doc_ids[:, None, :]).unsqueeze(1)


class LocalBackend(SameBatchForEveryCpRank):
    """Single-rank attention over whole rows."""

    def __init__(self, causal: bool):
        self.causal = causal
        self.attn_implementation = "sdpa" if causal else ATTENTION_NAME

    def shard(self, batch: TokenBatch) -> ShardedInputs:
        kwargs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
        coords = full_coords(batch.shape, batch.input_ids.device)
        if self.causal:
            return ShardedInputs(
                model_kwargs=kwargs, shift_labels=batch.shift_labels, call=None, coords=coords
            )
        mask = document_mask(batch.position_ids)

        def attend(q, k, v, scale):
            return sdpa_tokens_first(q, k, v, scale, attn_mask=mask)

        call = AttentionCall(attend=attend)
        return ShardedInputs(
            model_kwargs={**kwargs, ATTENTION_KWARG: call},
            shift_labels=batch.shift_labels,
            call=call,
            coords=coords,
        )
