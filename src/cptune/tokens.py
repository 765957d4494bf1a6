"""Token-level conventions shared by the data pipeline and the context-parallel sharding.

Both layers must agree on what is trained and where documents begin, or the
loss and the attention mask would disagree; so the two rules live here once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
"""Label of a token that is not trained (the default ``ignore_index`` of torch's cross entropy)."""


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool tensor, True where a new document begins.

    Token 0 of each row starts a document, and so does every token whose position
    is not the previous position + 1 (in particular every restart at 0). This is
    the rule transformers uses to detect packed documents
    (``masking_utils.find_packed_sequence_indices``), so cptune's loss, its varlen
    metadata and transformers' attention mask agree on what a document is.

    Args:
        position_ids: Integer tensor of shape ``(..., seq)``.

    Returns:
        Bool tensor of the same shape.
    """
    import torch

    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return starts
