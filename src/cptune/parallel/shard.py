"""Split one batch across the ranks of a context-parallel group — pure tensor code.

The batch arrives whole on every rank of the group (invariant 1) with
``shift_labels`` already built from the full rows, per document (invariant 2), so
no target is lost at a shard boundary. This module pads (invariant 3), splits, and
computes the varlen metadata from the *full* rows (invariant 4).

Two layouts:

* **varlen** (``varlen_llama3``): the ``B`` rows are laid end to end as one
  sequence of documents, padded to a multiple of ``cp_size`` with a padding
  document of its own, and split into contiguous slices. ``cu_seqlens`` describes
  the full sequence, so packed documents stay apart.
* **zigzag** (``batch_zigzag``): each row is padded to a multiple of ``2·cp_size``
  and cut into ``2·cp_size`` chunks; rank ``r`` keeps chunks ``r`` and
  ``2·cp_size-1-r``, which balances causal attention work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cptune.labels import IGNORE_INDEX, document_starts


@dataclass(frozen=True)
class TokenBatch:
    """Token tensors of one batch, all of shape (rows, tokens)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.input_ids.shape


@dataclass(frozen=True)
class TokenCoords:
    """Where each of a rank's tokens sits in the full batch: its row and its index in that row.

    Both int64, shaped like the rank's ``input_ids``. Padding added to split a batch
    evenly gets row -1. Exact dropout keys its masks on them (:mod:`cptune.parallel.dropout`),
    so every layout gives a token the mask that the whole row gets at cp=1.
    """

    rows: torch.Tensor
    columns: torch.Tensor


@dataclass(frozen=True)
class Shard:
    """This rank's part of a batch, plus what attention needs to know about the whole.

    ``cu_seqlens`` (int32) describes the full varlen sequence that the shard is a slice
    of; it is ``None`` for the per-row layouts (contiguous, zigzag).
    """

    tokens: TokenBatch
    cu_seqlens: torch.Tensor | None
    coords: TokenCoords


def full_coords(shape: torch.Size, device: torch.device | None = None) -> TokenCoords:
    """Coordinates of a whole (rows, tokens) batch: every token where it is."""
    rows, tokens = shape
    return TokenCoords(
        rows=torch.arange(rows, device=device).unsqueeze(1).expand(rows, tokens),
        columns=torch.arange(tokens, device=device).expand(rows, tokens),
    )


def contiguous_coords(shape: torch.Size, cp_size: int, cp_rank: int, device=None) -> TokenCoords:
    """Coordinates of rank ``cp_rank``'s contiguous slice of rows padded to a multiple of ``cp_size``."""
    rows, tokens = shape
    padded = tokens + (-tokens) % cp_size
    columns = split_contiguous(torch.arange(padded, device=device), cp_size, cp_rank)
    return _padding_rows(rows, columns, tokens)


def zigzag_coords(shape: torch.Size, cp_size: int, cp_rank: int, device=None) -> TokenCoords:
    """Coordinates of rank ``cp_rank``'s zigzag chunks of rows padded to a multiple of ``2·cp_size``."""
    rows, tokens = shape
    padded = tokens + (-tokens) % (2 * cp_size)
    return _padding_rows(rows, zigzag_indices(padded, cp_size, cp_rank, device=device), tokens)


def _padding_rows(rows: int, columns: torch.Tensor, tokens: int) -> TokenCoords:
    row_ids = torch.arange(rows, device=columns.device).unsqueeze(1).expand(rows, columns.numel())
    columns = columns.expand(rows, columns.numel())
    return TokenCoords(rows=torch.where(columns < tokens, row_ids, -1), columns=columns)


def cu_seqlens_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """Cumulative document lengths ``[0, l0, l0+l1, ..., total]`` (int32) of a 1-D start mask."""
    if starts.dim() != 1:
        raise ValueError("starts must be 1-D")
    total = starts.numel()
    begin = torch.nonzero(starts, as_tuple=False).flatten()
    end = torch.tensor([total], dtype=begin.dtype, device=begin.device)
    return torch.cat([begin, end]).to(torch.int32)


def pad_tokens(batch: TokenBatch, multiple: int, pad_token_id: int) -> TokenBatch:
    """Pad the token dim to a multiple; padding is a document of its own with no targets."""
    length = batch.shape[-1]
    pad = (-length) % multiple
    if pad == 0:
        return batch
    rows = batch.shape[0]
    like = batch.input_ids
    pad_ids = torch.full((rows, pad), pad_token_id, dtype=like.dtype, device=like.device)
    pad_labels = torch.full((rows, pad), IGNORE_INDEX, dtype=batch.shift_labels.dtype, device=like.device)
    pad_positions = torch.arange(pad, dtype=batch.position_ids.dtype, device=like.device).expand(rows, pad)
    return TokenBatch(
        input_ids=torch.cat([batch.input_ids, pad_ids], dim=-1),
        position_ids=torch.cat([batch.position_ids, pad_positions], dim=-1),
        shift_labels=torch.cat([batch.shift_labels, pad_labels], dim=-1),
    )


def split_contiguous(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = -1) -> torch.Tensor:
    """Rank ``cp_rank``'s contiguous slice of ``dim`` (whose size must divide by ``cp_size``)."""
    size = tensor.shape[dim]
    if size % cp_size:
        raise ValueError(f"dim of size {size} does not divide by cp_size={cp_size}")
    return tensor.narrow(dim, cp_rank * (size // cp_size), size // cp_size)


def zigzag_indices(
    length: int, cp_size: int, cp_rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """Token indices of rank ``cp_rank`` in the zigzag layout: chunks ``r`` and ``2C-1-r``."""
    chunks = 2 * cp_size
    if length % chunks:
        raise ValueError(f"length {length} does not divide into {chunks} zigzag chunks")
    chunk = length // chunks
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (chunks - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def split_zigzag(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = -1) -> torch.Tensor:
    """Rank ``cp_rank``'s zigzag part of ``dim``."""
    index = zigzag_indices(tensor.shape[dim], cp_size, cp_rank, device=tensor.device)
    return tensor.index_select(dim, index)


def _map(batch: TokenBatch, fn) -> TokenBatch:
    return TokenBatch(
        input_ids=fn(batch.input_ids),
        position_ids=fn(batch.position_ids),
        shift_labels=fn(batch.shift_labels),
    )


def shard_varlen(batch: TokenBatch, cp_size: int, cp_rank: int, pad_token_id: int) -> Shard:
    """Lay rows end to end, pad to a multiple of ``cp_size``, and keep a contiguous slice.

    Document boundaries are found per row before the rows are joined, so the end of
    one row can never run into the start of the next.
    """
    starts = document_starts(batch.position_ids).reshape(1, -1)
    flat = _map(batch, lambda t: t.reshape(1, -1))
    padded = pad_tokens(flat, cp_size, pad_token_id)
    pad = padded.shape[-1] - flat.shape[-1]
    if pad:
        pad_starts = torch.zeros((1, pad), dtype=torch.bool, device=starts.device)
        pad_starts[0, 0] = True
        starts = torch.cat([starts, pad_starts], dim=-1)
    cu_seqlens = cu_seqlens_from_starts(starts[0])
    local = _map(padded, lambda t: split_contiguous(t, cp_size, cp_rank))
    # The rows end to end: token g of the joined rows is token g % length of row g // length.
    rows, length = batch.shape
    joined = split_contiguous(torch.arange(padded.shape[-1], device=starts.device), cp_size, cp_rank)
    coords = TokenCoords(
        rows=torch.where(joined < rows * length, joined // length, -1).unsqueeze(0),
        columns=(joined % length).unsqueeze(0),
    )
    return Shard(tokens=local, cu_seqlens=cu_seqlens, coords=coords)


def shard_contiguous(batch: TokenBatch, cp_size: int, cp_rank: int, pad_token_id: int) -> Shard:
    """Pad each row to a multiple of ``cp_size`` and keep this rank's contiguous slice of every row."""
    padded = pad_tokens(batch, cp_size, pad_token_id)
    local = _map(padded, lambda t: split_contiguous(t, cp_size, cp_rank))
    coords = contiguous_coords(batch.shape, cp_size, cp_rank, device=batch.input_ids.device)
    return Shard(tokens=local, cu_seqlens=None, coords=coords)


def shard_zigzag(batch: TokenBatch, cp_size: int, cp_rank: int, pad_token_id: int) -> Shard:
    """Pad each row to a multiple of ``2·cp_size`` and keep this rank's zigzag chunks.

    Only valid for causal attention over rows that hold one document each: the
    trailing padding then cannot influence any real token.
    """
    padded = pad_tokens(batch, 2 * cp_size, pad_token_id)
    local = _map(padded, lambda t: split_zigzag(t, cp_size, cp_rank))
    coords = zigzag_coords(batch.shape, cp_size, cp_rank, device=batch.input_ids.device)
    return Shard(tokens=local, cu_seqlens=None, coords=coords)
