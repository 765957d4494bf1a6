"""The label conventions shared by the data pipeline, the context-parallel sharding and the loss.

``labels[i]`` is the label of token i itself (Hugging Face convention); the target of
position i is ``labels[i + 1]`` within the same document. Tokens that are not trained
carry :data:`IGNORE_INDEX`. Every layer must agree on what is trained and where documents
begin, or the loss and the attention mask would disagree; so the rules live here once.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def shift_labels_within_documents(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets computed per document: ``out[i] = labels[i + 1]`` inside a document, else -100.

    Build these from the full row before splitting it across context-parallel
    ranks: a rank that holds token i may not hold token i + 1. The last token of
    every document (and of the row) gets -100, so no document is trained to
    predict the start of the next one.

    Args:
        labels: Integer tensor ``(..., seq)`` with -100 where a token is not trained.
        position_ids: Integer tensor of the same shape; positions restart at 0 per document.

    Returns:
        A new tensor shaped like ``labels``; use it with logits unshifted
        (``loss = cross_entropy(logits[..., i, :], out[..., i])``).

    Raises:
        ValueError: If the shapes differ.
    """
    import torch

    if labels.shape != position_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and position_ids {tuple(position_ids.shape)} differ")
    shifted = torch.full_like(labels, IGNORE_INDEX)
    if labels.shape[-1] < 2:
        return shifted
    next_starts_new_document = document_starts(position_ids)[..., 1:]
    shifted[..., :-1] = labels[..., 1:].masked_fill(next_starts_new_document, IGNORE_INDEX)
    return shifted


def trained_token_count(labels: Sequence[int]) -> int:
    """Target tokens of one sample: labels after the first that are not -100.

    The first token of a sample is never predicted (nothing precedes it in its
    document), so its label does not count, whatever it is. This is the number
    of tokens the sample adds to a token-weighted loss.
    """
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


CHOSEN, REJECTED = 0, 1
"""The sides of a preference pair: a pair is two documents, the chosen response's then the rejected's."""


def pair_sequence_ids(
    position_ids: torch.Tensor, lengths: Sequence[int], *, one_side_per_row: bool = False
) -> torch.Tensor:
    """Which sequence of a batch of preference pairs each token belongs to: ``2·pair + side``, -1 on padding.

    A preference row holds whole pairs end to end, each two documents (prompt + chosen, prompt +
    rejected; :data:`CHOSEN`, :data:`REJECTED`), followed by padding; or, with ``one_side_per_row``,
    one side (rows ``2k`` and ``2k + 1`` the two sides of a pair). Pairs are numbered over the
    batch, row by row, so sequence ``2k`` is the chosen side of the batch's pair ``k`` and ``2k + 1``
    its rejected side: what the per-pair loss sums token log-probabilities by.

    Args:
        position_ids: Integer tensor ``(rows, tokens)``; positions restart at 0 per document.
        lengths: Real (non-padding) tokens of each row.
        one_side_per_row: Each row holds one document, a side of a pair.

    Raises:
        ValueError: A row's real tokens are not whole pairs (an odd number of documents), or with
            ``one_side_per_row`` a row holds other than one document or the rows are odd in number.
    """
    import torch

    tokens = position_ids.shape[-1]
    real = torch.arange(tokens, device=position_ids.device).unsqueeze(0) < torch.as_tensor(
        list(lengths), device=position_ids.device
    ).unsqueeze(1)
    in_row = document_starts(position_ids).logical_and(real).cumsum(-1) - 1
    per_row = in_row.masked_fill(~real, -1).amax(-1) + 1
    if one_side_per_row:
        if bool((per_row != 1).any()) or len(per_row) % 2:
            raise ValueError(
                f"a batch of pair sides holds {len(per_row)} rows of {per_row.tolist()} documents, not rows of "
                "one side each in chosen-rejected order"
            )
    elif bool((per_row % 2).any()):
        odd = int(torch.nonzero(per_row % 2)[0, 0])
        raise ValueError(
            f"row {odd} of the batch holds {int(per_row[odd])} documents, not whole preference pairs (two each)"
        )
    offset = per_row.cumsum(0) - per_row
    return torch.where(real, in_row + offset.unsqueeze(1), torch.full_like(in_row, -1))
