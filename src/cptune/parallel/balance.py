"""Causal attention work per context-parallel rank: how evenly a row's work falls on the ranks.

Pure arithmetic over position ids (numpy, no process group). A query at position
``p`` of its document attends to ``p + 1`` keys under causal masking, so the work
of a rank is the sum of ``p + 1`` over the tokens it holds. The token sets are
those of :mod:`cptune.parallel.shard`: ``contiguous`` is one slice per rank
(``split_contiguous``, the ``varlen_llama3`` layout and torch's ring without load
balancing), ``zigzag`` is chunks ``r`` and ``2C-1-r`` of ``2C`` (``zigzag_indices``,
``batch_zigzag`` and torch's load-balanced ring). A row is first padded as the
sharding pads it: to a multiple of ``C`` (contiguous) or ``2C`` (zigzag), the
padding being a document of its own whose work counts too (the kernels compute it).

The figure of merit is max/mean over the ranks: 1.0 is perfect balance, and a
step waits for the slowest rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

__all__ = [
    "SPLITS",
    "Split",
    "causal_work_per_rank",
    "imbalance",
    "padded_length",
    "rank_token_ranges",
]

Split = Literal["contiguous", "zigzag"]
SPLITS: tuple[Split, ...] = ("contiguous", "zigzag")


def padded_length(length: int, cp_size: int, split: Split) -> int:
    """The length a row of ``length`` tokens is padded to before it is split over ``cp_size`` ranks."""
    multiple = cp_size if split == "contiguous" else 2 * cp_size
    return length + (-length) % multiple


def rank_token_ranges(length: int, cp_size: int, split: Split) -> list[list[tuple[int, int]]]:
    """Per rank, the ``[start, stop)`` token ranges it holds of a (padded) row of ``length`` tokens.

    Raises:
        ValueError: If ``length`` is not a multiple of ``cp_size`` (``2·cp_size`` for zigzag),
            or ``split`` is unknown.
    """
    if split == "contiguous":
        if length % cp_size:
            raise ValueError(f"length {length} does not divide by cp_size={cp_size}")
        size = length // cp_size
        return [[(r * size, (r + 1) * size)] for r in range(cp_size)]
    if split == "zigzag":
        chunks = 2 * cp_size
        if length % chunks:
            raise ValueError(f"length {length} does not divide into {chunks} zigzag chunks")
        size = length // chunks
        return [
            [(r * size, (r + 1) * size), ((chunks - 1 - r) * size, (chunks - r) * size)]
            for r in range(cp_size)
        ]
    raise ValueError(f"unknown split {split!r}")


def causal_work_per_rank(position_ids: Sequence[int] | np.ndarray, cp_size: int, split: Split) -> list[int]:
    """(query, key) pairs each rank computes for one causal row, padded as the sharding pads it.

    Args:
        position_ids: The row's positions, restarting at 0 for every document (as stored and collated).
        cp_size: Ranks the row is split over.
        split: ``contiguous`` or ``zigzag``.

    Returns:
        One count per rank; they add up to the row's whole causal work (padding included).
    """
    positions = np.asarray(position_ids, dtype=np.int64)
    pad = padded_length(len(positions), cp_size, split) - len(positions)
    positions = np.concatenate([positions, np.arange(pad, dtype=np.int64)])
    # work[i] = pairs of tokens 0..i-1, so a range's pairs are one subtraction.
    work = np.concatenate([[0], np.cumsum(positions + 1)])
    return [
        int(sum(work[stop] - work[start] for start, stop in ranges))
        for ranges in rank_token_ranges(len(positions), cp_size, split)
    ]


def imbalance(values: Sequence[float]) -> float:
    """max / mean over the ranks (nan when every value is 0)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean else float("nan")
