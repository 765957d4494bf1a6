"""Causal attention work per rank: the token sets are the sharding's, the counts add up, the known ratios hold."""

from __future__ import annotations

import pytest
import torch

from cptune.parallel.balance import causal_work_per_rank, imbalance, padded_length, rank_token_ranges
from cptune.parallel.shard import TokenBatch, pad_tokens, split_contiguous, zigzag_indices


def _indices(ranges: list[tuple[int, int]]) -> list[int]:
    return [i for start, stop in ranges for i in range(start, stop)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("length", [48, 96, 240])
def test_token_ranges_are_the_sharding_functions_token_sets(cp, length):
    ranges = rank_token_ranges(length, cp, "contiguous")
    for rank in range(cp):
        assert _indices(ranges[rank]) == split_contiguous(torch.arange(length), cp, rank).tolist()
    ranges = rank_token_ranges(length, cp, "zigzag")
    for rank in range(cp):
        assert _indices(ranges[rank]) == zigzag_indices(length, cp, rank).tolist()


@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_rows_are_padded_as_the_sharding_pads_them_and_the_padding_counts(split):
    documents = [5, 9, 3]  # 17 tokens: padded to 18 (cp=2 contiguous) or 20 (zigzag, 2·cp)
    positions = torch.cat([torch.arange(n) for n in documents])
    multiple = 2 if split == "contiguous" else 4
    assert padded_length(17, 2, split) == 17 + (-17) % multiple
    batch = TokenBatch(positions[None], positions[None], torch.zeros(1, 17, dtype=torch.long))
    padded = pad_tokens(batch, multiple, pad_token_id=0).position_ids[0]
    assert len(padded) == padded_length(17, 2, split)
    index = [_indices(r) for r in rank_token_ranges(len(padded), 2, split)]
    expected = [int((padded[i] + 1).sum()) for i in index]
    assert causal_work_per_rank(positions.tolist(), 2, split) == expected
    # A query at position p sees p + 1 keys: every document's triangle, padding's included.
    pad = len(padded) - 17
    assert sum(expected) == sum(n * (n + 1) // 2 for n in [*documents, pad])


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_one_long_document_is_imbalanced_contiguous_and_balanced_zigzag(cp):
    positions = list(range(4096))
    assert imbalance(causal_work_per_rank(positions, cp, "contiguous")) == pytest.approx(
        (2 * cp - 1) / cp, rel=2e-3
    )
    assert imbalance(causal_work_per_rank(positions, cp, "zigzag")) == pytest.approx(1.0, abs=1e-3)


def test_unknown_split_and_uneven_lengths_are_refused():
    with pytest.raises(ValueError, match="unknown split"):
        rank_token_ranges(8, 2, "diagonal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not divide into 4 zigzag chunks"):
        rank_token_ranges(6, 2, "zigzag")
