"""Which keys of the zigzag ring a query chunk sees under a sliding window: the arithmetic, no collectives.

The zigzag split (:func:`cptune.parallel.shard.split_zigzag`) cuts every row into ``2 * cp_size`` chunks of
``chunk_len`` tokens and gives rank ``r`` chunks ``r`` and ``2 * cp_size - 1 - r``. A chunk's index is its
place in the whole row, so the block of query chunk ``a`` against key chunk ``b`` has the known offset
``d = (a - b) * chunk_len``: query row ``i`` and key row ``j`` of the block are ``d + i - j`` positions
apart in the sequence. transformers' window of ``w`` keys (``sliding_window``, the query's own included)
keeps key ``j`` when ``0 <= d + i - j < w``.

flash-attn's kernels align a window bottom-right: with ``n`` query and ``n`` key rows, query ``i`` sees
keys ``[i - left, i + right]``, both bounds non-negative. A block whose window starts past its first key
(``d >= w``) is cut to the ``t = d - w + 1`` last keys and the ``chunk_len - t`` first queries, which puts
the window back on the diagonal; every query left in such a block sees at least one key (itself on the
diagonal), so no call returns a row without keys, and the rows cut off get nothing from this block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkBlock:
    """How query chunk ``a`` attends key chunk ``b``: the rows each side keeps and the kernel's window.

    ``q_rows``/``k_rows`` are offsets within the chunks; ``left``/``right`` are flash-attn's
    ``window_size_left/right`` (-1: unbounded) for those rows, with ``causal`` False.
    """

    q_rows: slice
    k_rows: slice
    left: int
    right: int


def chunk_block(a: int, b: int, chunk_len: int, window: int | None) -> ChunkBlock | None:
    """The block of query chunk ``a`` against key chunk ``b`` of a causal row, or None where no key is seen.

    Args:
        a: The query chunk's index in the row (0 to ``2 * cp_size - 1``).
        b: The key chunk's index.
        chunk_len: Tokens per chunk.
        window: transformers' ``sliding_window`` (keys a query sees, its own included), None for full
            causal attention.
    """
    offset = (a - b) * chunk_len
    whole = slice(0, chunk_len)
    if offset < 0:
        return None  # keys after every query: causal attention sees none
    if window is None:
        return ChunkBlock(whole, whole, -1, 0) if offset == 0 else ChunkBlock(whole, whole, -1, -1)
    cut = max(0, offset - (window - 1))  # keys at the chunk's start every query's window has passed
    if cut >= chunk_len:
        return None  # the nearest pair (first query, last key) is `window` or more positions apart
    # In the cut rows, query i and key j are (offset - cut) + i - j apart: the window's bounds, shifted.
    return ChunkBlock(
        slice(0, chunk_len - cut), slice(cut, chunk_len), window - 1 - offset + cut, offset - cut
    )


def merge_block(
    out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold one block's attention into the running ``out``/``lse`` of query rows ``rows``, in place.

    Args:
        out: Running output ``(batch, tokens, heads, head_dim)``, in the merge's dtype.
        lse: Running log-sum-exp ``(batch, heads, tokens)``, -inf where a row has seen no key yet.
        rows: The query rows the block covers.
        block_out: The block's output ``(batch, len(rows), heads, head_dim)``.
        block_lse: The block's log-sum-exp ``(batch, heads, len(rows))``, finite (every row saw a key).
    """
    old = lse[:, :, rows]
    block_lse = block_lse.to(lse.dtype)
    # The two shares divided by their own sum, so that they add up to 1 within a few roundings of 1. Shares
    # exp(old - new) and exp(block_lse - new) from the rounded new = logaddexp(old, block_lse) would miss 1 by
    # new's rounding (half an ulp of |new|, 3e-5 at |lse| near 1000): one scale error of the whole row, the kind
    # the forward kernel no longer makes either (cptune.parallel.kernels.blockwise.attend_forward).
    top = torch.maximum(old, block_lse)  # finite: block_lse is
    keep = torch.exp(old - top)  # 0 where the row has seen no key yet (old = -inf)
    take = torch.exp(block_lse - top)
    total = keep + take  # >= 1: one of the two is exp(0)

    def share(weight: torch.Tensor) -> torch.Tensor:
        return (weight / total).transpose(1, 2).unsqueeze(-1).to(out.dtype)

    out[:, rows] = share(keep) * out[:, rows] + share(take) * block_out.to(out.dtype)
    lse[:, :, rows] = top + torch.log(total)
