"""Exact deduplication of tokenized samples (the recipe's ``dataset_exact_deduplication``).

Two samples are duplicates when everything stored of them is equal: ``input_ids``, ``labels``
and ``position_ids``. Each sample is reduced to a sha256 digest of those three columns and a
sample whose digest was seen before is dropped, so the first copy in the order given is the
one kept. :func:`cptune.data.prepare.prepare_datasets` runs this where Axolotl runs its own
(``deduplicate_and_log_datasets``): on the tokenized samples after the length policy, before
the validation split and before packing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import pyarrow as pa

from cptune.data.rows import SAMPLE_COLUMNS

__all__ = ["Deduplicated", "drop_duplicates", "sample_digests"]


def _column_slices(table: pa.Table, name: str) -> Iterator[bytes]:
    """The bytes of each row's list in column ``name``, preceded by its length."""
    column = table.column(name).combine_chunks()
    # offsets index into values (the whole backing array, whatever slice the column is).
    offsets = column.offsets.to_numpy()
    values = np.ascontiguousarray(column.values.to_numpy(zero_copy_only=False))
    for start, stop in pairwise(offsets):
        yield int(stop - start).to_bytes(8, "little") + values[start:stop].tobytes()


def sample_digests(table: pa.Table) -> list[bytes]:
    """One sha256 digest per sample (row) of ``table``, over its ``input_ids``, ``labels`` and ``position_ids``.

    Each column's part is prefixed with its length, so equal digests mean equal columns (up to a
    sha256 collision).
    """
    digests = []
    for parts in zip(*(_column_slices(table, name) for name in SAMPLE_COLUMNS), strict=True):
        digest = hashlib.sha256()
        for part in parts:
            digest.update(part)
        digests.append(digest.digest())
    return digests


@dataclass(frozen=True)
class Deduplicated:
    """What :func:`drop_duplicates` kept and dropped.

    Attributes:
        kept: Each table given, without its duplicates (rows in their order).
        dropped: Each table's dropped samples (one copy per drop), in the same order.
        seen: The digests of every sample kept, and of those given as ``earlier``.
    """

    kept: list[pa.Table]
    dropped: list[pa.Table]
    seen: frozenset[bytes]


def drop_duplicates(tables: Sequence[pa.Table], *, earlier: Set[bytes] = frozenset()) -> Deduplicated:
    """Drop every sample that equals one before it: in an earlier table, earlier in its own, or in ``earlier``.

    Args:
        tables: Tables of samples (the columns of :data:`cptune.data.rows.SAMPLE_COLUMNS`), taken in order as
            one sequence.
        earlier: Digests (:func:`sample_digests`) of samples met before these, e.g. the training samples
            when the evaluation samples are deduplicated against them.

    Returns:
        The tables without their duplicates, what was dropped of each, and the digests seen.
    """
    seen = set(earlier)
    kept, dropped = [], []
    for table in tables:
        keep = np.zeros(table.num_rows, dtype=bool)
        for i, digest in enumerate(sample_digests(table)):
            if digest not in seen:
                seen.add(digest)
                keep[i] = True
        kept.append(table.filter(pa.array(keep)))
        dropped.append(table.filter(pa.array(~keep)))
    return Deduplicated(kept=kept, dropped=dropped, seen=frozenset(seen))
