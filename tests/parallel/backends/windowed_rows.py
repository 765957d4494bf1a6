"""The packed row the sliding-window and attention-sink tests share: 3 short documents, then one wider than the window."""

from __future__ import annotations

import torch

from cptune.labels import shift_labels_within_documents
from cptune.parallel.shard import TokenBatch

VOCAB = 97
WINDOW = 5
# 3 short documents, then one of 16 tokens, wider than the window of 5.
DOCUMENTS = [3, 2, 4, 16]


def packed_batch() -> TokenBatch:
    """One row of :data:`DOCUMENTS`, seeded token ids, positions restarting at each document."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (1, sum(DOCUMENTS)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    return TokenBatch(ids, positions, shift_labels_within_documents(ids.clone(), positions))


def logits(model: torch.nn.Module, kwargs: dict) -> torch.Tensor:
    """The model's logits for ``kwargs``, without gradients."""
    with torch.no_grad():
        return model(**kwargs, use_cache=False).logits
