import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cptune.parallel.shard import (
    IGNORE_INDEX,
    TokenBatch,
    cu_seqlens_from_starts,
    document_starts,
    pad_tokens,
    shard_varlen,
    shard_zigzag,
    split_zigzag,
    zigzag_indices,
)
from tests.parallel.unshard import unshard_contiguous, unshard_zigzag


def packed_row(doc_lengths, pad=0):
    positions = [p for n in doc_lengths for p in range(n)] + list(range(pad))
    return torch.tensor(positions)


def make_batch(rows):
    position_ids = torch.stack([packed_row(r) for r in rows])
    n_rows, length = position_ids.shape
    input_ids = torch.arange(n_rows * length).reshape(n_rows, length) + 1000
    shift_labels = input_ids + 1
    return TokenBatch(input_ids=input_ids, position_ids=position_ids, shift_labels=shift_labels)


docs = st.lists(st.integers(1, 9), min_size=1, max_size=5)


@st.composite
def batches(draw):
    length = draw(st.integers(1, 30))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        row, left = [], length
        while left:
            n = draw(st.integers(1, left))
            row.append(n)
            left -= n
        rows.append(row)
    return rows


def test_document_starts_follow_position_restarts():
    starts = document_starts(packed_row([3, 2, 4]).unsqueeze(0))[0]
    assert starts.tolist() == [True, False, False, True, False, True, False, False, False]
    assert cu_seqlens_from_starts(starts).tolist() == [0, 3, 5, 9]


@settings(max_examples=60, deadline=None)
@given(rows=batches(), cp_size=st.sampled_from([1, 2, 3, 4]))
def test_varlen_shards_reassemble_to_the_padded_sequence(rows, cp_size):
    batch = make_batch(rows)
    shards = [shard_varlen(batch, cp_size, r, pad_token_id=0) for r in range(cp_size)]
    whole = unshard_contiguous([s.tokens.input_ids for s in shards])
    flat = batch.input_ids.reshape(1, -1)
    pad = whole.shape[-1] - flat.shape[-1]
    assert 0 <= pad < cp_size
    assert torch.equal(whole[:, : flat.shape[-1]], flat)
    assert (whole[:, flat.shape[-1] :] == 0).all()
    labels = unshard_contiguous([s.tokens.shift_labels for s in shards])
    assert (labels[:, flat.shape[-1] :] == IGNORE_INDEX).all()
    # Every rank sees the same full-sequence cu_seqlens: each row's documents, then padding.
    cu = shards[0].cu_seqlens.tolist()
    expected, offset = [0], 0
    for row in rows:
        for n in row:
            offset += n
            expected.append(offset)
    if pad:
        expected.append(offset + pad)
    assert cu == expected
    assert all(s.cu_seqlens.tolist() == cu for s in shards)


def test_rows_never_merge_even_when_positions_continue():
    # Row 2 starts at position 4 right after row 1 ended at 3: still a new document.
    batch = TokenBatch(
        input_ids=torch.ones(2, 4, dtype=torch.long),
        position_ids=torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]),
        shift_labels=torch.ones(2, 4, dtype=torch.long),
    )
    assert shard_varlen(batch, 2, 0, 0).cu_seqlens.tolist() == [0, 4, 8]


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 40), cp_size=st.sampled_from([1, 2, 3, 4]))
def test_zigzag_roundtrip_and_balance(length, cp_size):
    batch = make_batch([[length], [length]])
    shards = [shard_zigzag(batch, cp_size, r, pad_token_id=0) for r in range(cp_size)]
    padded = pad_tokens(batch, 2 * cp_size, 0)
    assert torch.equal(unshard_zigzag([s.tokens.input_ids for s in shards]), padded.input_ids)
    assert torch.equal(unshard_zigzag([s.tokens.position_ids for s in shards]), padded.position_ids)
    sizes = {s.tokens.input_ids.shape[-1] for s in shards}
    assert len(sizes) == 1


def test_zigzag_indices_pair_early_and_late_chunks():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(8)
    assert split_zigzag(x, 2, 1).tolist() == [2, 3, 4, 5]


def test_padding_is_its_own_document_without_targets():
    batch = make_batch([[3]])
    padded = pad_tokens(batch, 4, pad_token_id=7)
    assert padded.input_ids[0, 3].item() == 7
    assert padded.position_ids[0].tolist() == [0, 1, 2, 0]
    assert padded.shift_labels[0, 3].item() == IGNORE_INDEX
