"""Sample packing: put several tokenized samples into one row of ``sequence_len`` tokens.

Pure functions on lengths and lists of ints (and, for whole datasets, on
arrow tables); no torch, no datasets. A packed row
keeps its samples apart through ``position_ids`` that restart at 0 for every
sample: transformers (``masking_utils.find_packed_sequence_indices``) and the
varlen attention kernels read document boundaries from exactly that, and
:func:`cptune.data.collator.shift_labels_within_documents` uses the same rule so
that no document predicts the first token of the next one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "first_fit_decreasing",
    "pack_samples",
    "pack_table",
    "packing_efficiency",
    "position_ids_for",
    "with_position_ids",
]


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack sample lengths into as few bins of ``capacity`` tokens as first-fit-decreasing finds.

    Samples are placed longest first (ties by index, so the result is
    deterministic), each into the first bin that still has room. The first bin
    with room is found in O(log n) with a max segment tree over the remaining
    room of n pre-allocated bins (an unopened bin has full room, so "open a new
    bin" is just "the first untouched leaf"), which makes the whole packing
    O(n log n) instead of the O(n x bins) of a linear scan.

    Args:
        lengths: Token count of each sample; every entry must be in ``1..capacity``.
        capacity: Tokens per bin (the recipe's ``sequence_len``).

    Returns:
        One list of sample indices per bin, bins in the order they were opened and
        indices ascending within a bin. Every index appears exactly once.

    Raises:
        ValueError: If ``capacity`` < 1 or a length is outside ``1..capacity``
            (callers drop or truncate over-long samples before packing).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    n = len(lengths)
    for index, length in enumerate(lengths):
        if not 1 <= length <= capacity:
            raise ValueError(f"sample {index} has length {length}; packing needs 1..{capacity}")
    if n == 0:
        return []

    leaves = 1
    while leaves < n:
        leaves *= 2
    # tree[1] is the root; tree[leaves + b] is the room left in bin b. Leaves
    # beyond n can never be chosen because n bins always suffice.
    room = [0] * (2 * leaves)
    for b in range(n):
        room[leaves + b] = capacity
    for node in range(leaves - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])

    bins: list[list[int]] = []
    for index in sorted(range(n), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        node = 1
        while node < leaves:
            node = 2 * node if room[2 * node] >= length else 2 * node + 1
        bin_index = node - leaves
        if bin_index == len(bins):
            bins.append([])
        bins[bin_index].append(index)
        room[node] -= length
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    for members in bins:
        members.sort()
    return bins


def position_ids_for(lengths: Sequence[int]) -> list[int]:
    """Position ids of a row holding samples of these lengths: 0..n-1 for each sample in turn."""
    positions: list[int] = []
    for length in lengths:
        positions.extend(range(length))
    return positions


def with_position_ids(sample: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    """An unpacked row: the sample's ``input_ids`` and ``labels`` plus positions 0..n-1."""
    input_ids = list(sample["input_ids"])
    return {
        "input_ids": input_ids,
        "labels": list(sample["labels"]),
        "position_ids": list(range(len(input_ids))),
    }


def pack_samples(samples: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, list[int]]:
    """Concatenate samples into one packed row whose positions restart at 0 for every sample.

    Args:
        samples: Rows with ``input_ids`` and ``labels`` of equal length.

    Returns:
        A row with ``input_ids``, ``labels`` and ``position_ids``, in the order given.

    Raises:
        ValueError: If a sample is empty or its ``labels`` and ``input_ids`` differ in length.
    """
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for number, sample in enumerate(samples):
        input_ids, labels = sample["input_ids"], sample["labels"]
        if not input_ids or len(input_ids) != len(labels):
            raise ValueError(
                f"sample {number}: needs 1+ tokens and as many labels ({len(input_ids)} ids, {len(labels)} labels)"
            )
        row["input_ids"].extend(input_ids)
        row["labels"].extend(labels)
        row["position_ids"].extend(range(len(input_ids)))
    return row


def packing_efficiency(real_tokens: int, num_rows: int, sequence_len: int) -> float:
    """Share of row capacity filled with real tokens: ``real_tokens / (num_rows * sequence_len)``."""
    if num_rows == 0 or sequence_len == 0:
        return 0.0
    return real_tokens / (num_rows * sequence_len)


def pack_table(
    table: pa.Table, bins: Sequence[Sequence[int]], *, max_chunk_tokens: int = 1 << 30
) -> pa.Table:
    """Build the packed rows of a table of samples: the arrow form of :func:`pack_samples`.

    Every list column (``input_ids``, ``labels``, ``position_ids``) of the samples
    of a bin is concatenated into one row; since each sample's ``position_ids``
    already run 0..n-1, the packed positions restart at 0 for every sample. No
    token goes through Python; rows are built in chunks of at most
    ``max_chunk_tokens`` tokens so that arrow's int32 list offsets cannot overflow.

    Args:
        table: Samples with int list columns of equal lengths per row.
        bins: Sample indices per packed row, e.g. from :func:`first_fit_decreasing`.
        max_chunk_tokens: Token budget of one arrow chunk (a single row may exceed it).

    Returns:
        A table with the same columns and one row per bin, in bin order.
    """
    names = table.column_names
    if not bins:
        return table.slice(0, 0)
    lengths = pc.list_value_length(table.column(names[0])).to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.fromiter((i for members in bins for i in members), dtype=np.int64)
    # Token offset of every sample start in packed order, and the index into
    # `order` where every bin starts; bin b spans samples first[b]:first[b+1].
    token_at = np.concatenate([[0], np.cumsum(lengths[order])])
    first = np.concatenate([[0], np.cumsum([len(members) for members in bins])])
    chunks: dict[str, list[pa.Array]] = {name: [] for name in names}
    start = 0
    while start < len(bins):
        # The most bins from `start` that fit the token budget, at least one.
        limit = token_at[first[start]] + max_chunk_tokens
        stop = max(start + 1, int(np.searchsorted(token_at[first], limit, side="right")) - 1)
        stop = min(stop, len(bins))
        samples = order[first[start] : first[stop]]
        offsets = token_at[first[start : stop + 1]] - token_at[first[start]]
        taken = table.take(pa.array(samples))
        for name in names:
            values = pc.list_flatten(taken.column(name)).combine_chunks()
            chunks[name].append(pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values))
        start = stop
    return pa.table({name: pa.chunked_array(arrays) for name, arrays in chunks.items()})
