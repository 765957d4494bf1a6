"""The cp=1 reference for gpt-oss: transformers' eager attention (with its sinks) given the documents' masks.

transformers 5.23's ``GptOssModel.forward`` builds its causal and sliding-window masks without the
call's ``position_ids`` (``mask_kwargs`` has none), so it never finds the packed documents of a row
(``masking_utils.find_packed_sequence_indices``) and lets them attend to each other. (Its forward takes
ready-made masks as an ``attention_mask`` dict, but then its router loss, which reads the same
argument as a padding mask, fails.) This backend's attention function is transformers' own
``modeling_gpt_oss.eager_attention_forward`` given masks built from ``position_ids`` instead, which
ride the forward's keywords (``document_masks``) as cptune's per-batch metadata does: each document
causal within itself, and on sliding layers each query's last ``sliding_window`` keys.
tests/parallel/backends/test_attention_sinks.py checks it against the model run on each document alone.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface

from cptune.labels import document_starts
from cptune.parallel.backends.base import ShardedInputs
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.shard import TokenBatch


def additive_mask(position_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """(rows, 1, tokens, tokens) float32: 0 where a query sees a key of its document (within ``window``), -inf
    elsewhere. float32, so that a float64 model's scores stay float64 and a float32 model's float32."""
    documents = document_starts(position_ids).cumsum(-1)
    index = torch.arange(position_ids.shape[-1])
    distance = index[:, None] - index[None, :]
    seen = (documents[:, :, None] == documents[:, None, :]) & (distance >= 0)
    if window is not None:
        seen &= distance < window
    mask = torch.zeros(seen.shape, dtype=torch.float32).masked_fill(~seen, float("-inf"))
    return mask.unsqueeze(1)


MASKED_EAGER = "gpt_oss_masked_eager"
MASKS_KWARG = "document_masks"


def masked_eager_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' eager gpt-oss attention with the batch's document mask of the layer's kind."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    masks = kwargs.pop(MASKS_KWARG)
    mask = masks["sliding_attention" if module.sliding_window is not None else "full_attention"]
    kwargs.pop("sliding_window", None)
    return eager_attention_forward(module, query, key, value, mask, **kwargs)


class MaskedEagerBackend(LocalBackend):
    """cp=1 over whole rows through transformers' eager gpt-oss attention, the documents' masks given.

    The reference model runs with ``attn_implementation`` :data:`MASKED_EAGER` (registered here).
    """

    attn_implementation = MASKED_EAGER

    def __init__(self, sliding_window: int | None):
        super().__init__(causal=True)
        self.attn_implementation = MASKED_EAGER
        self.window = sliding_window
        AttentionInterface.register(MASKED_EAGER, masked_eager_forward)

    def shard(self, batch: TokenBatch) -> ShardedInputs:
        sharded = super().shard(batch)
        masks = {
            "full_attention": additive_mask(batch.position_ids, None),
            "sliding_attention": additive_mask(batch.position_ids, self.window),
        }
        return dataclasses.replace(sharded, model_kwargs={**sharded.model_kwargs, MASKS_KWARG: masks})
