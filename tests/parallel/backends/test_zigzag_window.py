"""Sliding windows and attention sinks on the zigzag ring: each block's window in whole-row positions, the sink
once onto the merged attention (zigzag_blocks, zigzag_window).

The ring itself at cp=2 and cp=4 is in tests/parallel/test_parity.py (the zigzag window and gpt-oss cases, and
a window aligned to each block or a sink applied to each block instead, planted, that the check catches).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from cptune.parallel.backends.ring_flash_attn.zigzag_blocks import chunk_block, merge_block
from cptune.parallel.backends.ring_flash_attn.zigzag_window import ZigzagRing, zigzag_window_attention
from cptune.parallel.kernels import flash_attn_cpu
from cptune.parallel.kernels.sinks import attention_with_sinks, with_sinks
from tests.numerics import assert_float64_twins_rule, reorder_bound
from tests.parallel.kernel_tests.dense_reference import reference_attention
from tests.token_orders import (
    TWIN_ORDERS,
    assert_distinct_draws,
    assert_legal_twin,
    put_back,
    take_features,
    token_order,
)

KERNELS = (flash_attn_cpu._flash_attn_forward, flash_attn_cpu._flash_attn_backward)


def sees(rows: int, window: int | None, order: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' causal sliding window over one row: query q sees key k when 0 <= q - k < window; ``order``:
    the row's tokens taken in that order (tests/token_orders.py), the mask following them."""
    order = torch.arange(rows) if order is None else order
    gap = order[:, None] - order[None, :]
    return (gap >= 0) & (gap < window if window is not None else True)


def block_mask(a: int, b: int, chunk_len: int, window: int | None) -> torch.Tensor:
    """What chunk_block lets query chunk ``a`` see of key chunk ``b`` (flash-attn's bottom-right window)."""
    mask = torch.zeros(chunk_len, chunk_len, dtype=torch.bool)
    block = chunk_block(a, b, chunk_len, window)
    if block is None:
        return mask
    rows = block.q_rows.stop - block.q_rows.start
    keys = block.k_rows.stop - block.k_rows.start
    assert rows == keys  # equal lengths: bottom-right alignment is the diagonal
    gap = torch.arange(keys)[None, :] - torch.arange(rows)[:, None]  # key minus query, in the cut rows
    seen = torch.ones(rows, keys, dtype=torch.bool)
    if block.left >= 0:
        seen &= gap >= -block.left
    if block.right >= 0:
        seen &= gap <= block.right
    assert seen.any(dim=1).all(), (a, b, chunk_len, window, block)  # no row of a kernel call sees no key
    mask[block.q_rows, block.k_rows] = seen
    return mask


@pytest.mark.parametrize("window", [None, 1, 2, 3, 4, 5, 7, 13, 40])
def test_the_blocks_see_exactly_the_window_of_the_whole_row(window):
    """Every (query chunk, key chunk) pair, put back at its place in the row, is transformers' window there:
    blocks wholly outside it skipped, blocks across its edge cut, for 2 to 8 chunks of 1 to 5 tokens."""
    for chunks, chunk_len in itertools.product((2, 4, 6, 8), (1, 2, 3, 5)):
        rows = chunks * chunk_len
        got = torch.zeros(rows, rows, dtype=torch.bool)
        for a, b in itertools.product(range(chunks), repeat=2):
            got[a * chunk_len : (a + 1) * chunk_len, b * chunk_len : (b + 1) * chunk_len] = block_mask(
                a, b, chunk_len, window
            )
        assert torch.equal(got, sees(rows, window)), (chunks, chunk_len, window)


def test_merging_into_rows_that_have_seen_no_key_gives_the_blocks_attention():
    """The running lse starts at -inf: the first block of a row replaces it, with no NaN."""
    out, lse = torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), float("-inf"))
    block_out, block_lse = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2)
    merge_block(out, lse, slice(1, 3), block_out, block_lse)
    assert torch.equal(out[:, 1:], block_out) and torch.equal(lse[:, :, 1:], block_lse)
    assert torch.equal(out[:, :1], torch.zeros(1, 1, 2, 4)) and torch.isinf(lse[:, :, :1]).all()


def test_merged_rows_of_values_all_1_stay_1_when_the_lse_is_large():
    """Blocks whose outputs are all 1 merge into 1: the two shares of each merge add up to 1, however large the lse.

    Bound: each merge takes a share ``a / (a + b)`` of the running row and ``b / (a + b)`` of the block (one
    addition, two divisions: within 3u of exact, so within ``reorder_bound(3, 1)`` of shares that add up to 1),
    then adds the two products (two multiplications, one addition: ``reorder_bound(3, 1)``); over ``merges``
    merges the errors add, ``reorder_bound(6 * merges, 1)``. Shares ``exp(lse - logaddexp(...))`` (the merge
    before) would miss 1 by the rounding of the new lse, half an ulp of 1000 (3e-5), at every merge.
    """
    generator = torch.Generator().manual_seed(0)
    merges, rows, heads = 8, 64, 4
    out, lse = torch.zeros(1, rows, heads, 16), torch.full((1, heads, rows), float("-inf"))
    for _ in range(merges):
        block_lse = 1000 + 5 * torch.randn(1, heads, rows, generator=generator)
        merge_block(out, lse, slice(0, rows), torch.ones(1, rows, heads, 16), block_lse)
    assert lse.min() > 900
    excess = ((out - 1).abs() / reorder_bound(6 * merges, 1.0)).max()
    assert excess <= 1, f"merged rows of values all 1 are {excess:.3g}x the bound away from 1"


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("a process group was left open by an earlier test")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dense(q, k, v, window, scale, order=None):
    """Windowed causal attention over the whole row (grouped-query heads; a query sees the ``window`` keys up to
    itself, as :func:`sees`), the reference: dense_reference.py's ``reference_attention``; ``order``: a twin's
    (tests/token_orders.py), the row's tokens and the head's features taken in that order and the output put back."""
    left = -1 if window is None else window - 1
    return reference_attention(q, k, v, causal=True, window=(left, 0), scale=scale, order=order)[0]


@pytest.mark.parametrize("window", [2, 3, 6, 9])  # 1: each query sees itself only, so dk is 0
def test_the_ring_of_one_rank_is_windowed_attention_forward_and_backward(window):
    """At cp=1 the row is 2 chunks on one rank: the ring's blocks (the diagonal ones, and the second chunk's
    queries on the first chunk's keys, cut at the window's edge) against dense windowed attention. Outputs
    and gradients of q, k, v by the twins rule (tests/numerics.py): the fp32 ring against the dense attention in
    float64, as far as fp32 dense attention in the tokens' own order and 2 others may land."""
    generator = torch.Generator().manual_seed(0)
    batch, tokens, heads, kv_heads, dim = 2, 12, 4, 2, 8
    inputs = [
        torch.randn(batch, tokens, n, dim, generator=generator, dtype=torch.float64)
        for n in (heads, kv_heads, kv_heads)
    ]
    dout = torch.randn(batch, tokens, heads, dim, generator=generator, dtype=torch.float64)
    scale = dim**-0.5

    def run(attend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in inputs]
        out = attend(*leaves)
        out.backward(dout.to(dtype))
        return {"out": out.detach(), **{n: t.grad for n, t in zip("qkv", leaves, strict=True)}}

    with one_process_group():
        ring = run(
            lambda q, k, v: zigzag_window_attention(q, k, v, scale, window, None, KERNELS), torch.float32
        )
    references = [
        run(lambda q, k, v, o=o: dense(q, k, v, window, scale, o), torch.float32)
        for o in (None, *TWIN_ORDERS)
    ]
    ref64 = run(lambda q, k, v: dense(q, k, v, window, scale), torch.float64)
    assert_float64_twins_rule(ring, references, ref64, what=f"window {window}")


# --- attention sinks (gpt-oss) on the zigzag ring ----------------------------------------------------------


def dense_with_sinks(q, k, v, sinks, window, scale, order=None):
    """gpt-oss's attention over the whole row: softmax over [windowed causal scores, the head's sink], the sink
    dropped from the output (transformers' ``modeling_gpt_oss.eager_attention_forward``); ``order``: a twin's
    (tests/token_orders.py), the row's tokens and the head's features taken in that order and the output put back."""
    tokens = token_order(q.shape[1], order)
    features, (q, k, v) = take_features(order, q[:, tokens], k[:, tokens], v[:, tokens])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)) * scale
    scores = scores.masked_fill(~sees(q.shape[1], window, tokens), float("-inf"))
    sink = sinks[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(q.shape[2] // v.shape[2], dim=2))
    return put_back(put_back(out, tokens, 1), features, -1)


def dense_references(inputs, dout, window, scale):
    """fp32 dense attention with sinks in the tokens' own order and in 2 others (the twins rule), and in float64."""
    references = [
        run_with_sinks(
            lambda q, k, v, s, o=o: dense_with_sinks(q, k, v, s, window, scale, o),
            inputs,
            dout,
            torch.float32,
        )
        for o in (None, *TWIN_ORDERS)
    ]
    ref64 = run_with_sinks(
        lambda q, k, v, s: dense_with_sinks(q, k, v, s, window, scale), inputs, dout, torch.float64
    )
    return references, ref64


def sinks_per_block(sinks: torch.Tensor):
    """Planted bug: flash-attn's forward with the sink put into each block's ``(out, lse)`` before the ring merges the
    blocks, so it enters a query's softmax once per block it sees (per ring step and chunk), not once."""
    forward, backward = KERNELS

    def forward_with_sink(**kwargs):
        out, lse, *rest = forward(**kwargs)
        out, lse = with_sinks(out, lse, sinks)
        return (out, lse, *rest)

    return forward_with_sink, backward


def run_with_sinks(attend, inputs, dout, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    out = attend(*leaves)
    out.backward(dout.to(dtype))
    return {"out": out.detach(), **{n: t.grad for n, t in zip(("q", "k", "v", "sinks"), leaves, strict=True)}}


def sink_inputs():
    generator = torch.Generator().manual_seed(1)
    batch, tokens, heads, kv_heads, dim = 2, 12, 4, 2, 8
    inputs = [
        torch.randn(batch, tokens, n, dim, generator=generator, dtype=torch.float64)
        for n in (heads, kv_heads, kv_heads)
    ]
    sinks = torch.linspace(-2.0, 2.0, heads, dtype=torch.float64)  # of either sign, live in the softmax
    dout = torch.randn(batch, tokens, heads, dim, generator=generator, dtype=torch.float64)
    return [*inputs, sinks], dout, dim**-0.5


@pytest.mark.parametrize("window", [None, 3, 6])
def test_the_sink_goes_once_onto_the_zigzag_rings_merged_attention_forward_and_backward(window):
    """The zigzag ring (one rank: its 2 chunks, 3 blocks merged) as a SplitAttention with gpt-oss's sinks, full
    causal and windowed, against gpt-oss's softmax over [scores, sink]: outputs and gradients of q, k, v and the
    sinks by the twins rule (tests/numerics.py): the fp32 ring against the dense attention in float64, as far as
    fp32 dense attention in the tokens' own order and 2 others may land. The ring across ranks (cp=2, cp=4) is in tests/parallel/test_parity.py."""
    inputs, dout, scale = sink_inputs()
    ring = ZigzagRing(scale, window, None, KERNELS)
    with one_process_group():
        got = run_with_sinks(
            lambda q, k, v, s: attention_with_sinks(ring, q, k, v, s), inputs, dout, torch.float32
        )
    references, ref64 = dense_references(inputs, dout, window, scale)
    assert float(ref64["sinks"].abs().max()) > 1e-2  # the sinks' gradient is live
    assert_float64_twins_rule(got, references, ref64, what=f"window {window}")


@pytest.mark.parametrize("window", [None, 2, 3])  # 2: 2 keys a query, alike in any order: the features tell
def test_the_dense_twins_compute_the_reference_function_in_another_order(window):
    """The twins of ``dense`` and ``dense_with_sinks`` (tests/token_orders.py) are legal: the same function, a
    noise of their own in every tensor (``assert_distinct_draws``)."""
    inputs, dout, scale = sink_inputs()
    for name, attend in {
        "dense": lambda q, k, v, s, o: dense(q, k, v, window, scale, o) + 0 * s.sum(),
        "sinks": lambda q, k, v, s, o: dense_with_sinks(q, k, v, s, window, scale, o),
    }.items():
        ref64, ref32, *twins = (
            run_with_sinks(functools.partial(attend, o=o), inputs, dout, dtype)
            for o, dtype in [(None, torch.float64), (None, torch.float32)]
            + [(o, dtype) for o in TWIN_ORDERS for dtype in (torch.float64, torch.float32)]
        )
        for order, twin64, twin32 in zip(TWIN_ORDERS, twins[0::2], twins[1::2], strict=True):
            assert_legal_twin(twin64, ref64, twin32, ref32, what=f"{name} {order}")
        assert_distinct_draws([ref32, *twins[1::2]], what=name)


@pytest.mark.parametrize("window", [None, 6])
def test_a_sink_applied_per_block_of_the_ring_fails_the_same_check(window):
    """Planted: the sink put into each block before the merge (once per block a query sees), and not once after."""
    inputs, dout, scale = sink_inputs()
    planted = ZigzagRing(scale, window, None, sinks_per_block(inputs[3].float()))
    no_sink = torch.full_like(inputs[3], float("-inf"))
    with one_process_group():
        got = run_with_sinks(
            lambda q, k, v, s: attention_with_sinks(planted, q, k, v, s + no_sink.float()),
            inputs,
            dout,
            torch.float32,
        )
    references, ref64 = dense_references(inputs, dout, window, scale)
    for results in (got, *references, ref64):
        results.pop("sinks")  # the planted sink is a constant here; q, k, v and the output must show it
    with pytest.raises(AssertionError, match="times the tolerance"):
        assert_float64_twins_rule(got, references, ref64, what=f"planted, window {window}")
