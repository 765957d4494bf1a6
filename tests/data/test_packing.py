"""Bin packing and packed rows: nothing lost, nothing over capacity, positions restart per sample."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cptune.data.packing import (
    first_fit_decreasing,
    pack_samples,
    pack_table,
    packing_efficiency,
    position_ids_for,
    with_position_ids,
)


@st.composite
def lengths_and_capacity(draw: st.DrawFn) -> tuple[list[int], int]:
    capacity = draw(st.integers(min_value=1, max_value=64))
    lengths = draw(st.lists(st.integers(min_value=1, max_value=capacity), max_size=80))
    return lengths, capacity


@settings(max_examples=200, deadline=None)
@given(lengths_and_capacity())
def test_ffd_places_every_sample_once_within_capacity(case: tuple[list[int], int]) -> None:
    lengths, capacity = case
    bins = first_fit_decreasing(lengths, capacity)
    placed = sorted(i for members in bins for i in members)
    assert placed == list(range(len(lengths)))
    assert all(members and sum(lengths[i] for i in members) <= capacity for members in bins)
    # Deterministic, and never worse than the volume bound allows.
    assert first_fit_decreasing(lengths, capacity) == bins
    assert len(bins) >= -(-sum(lengths) // capacity)


@settings(max_examples=100, deadline=None)
@given(lengths_and_capacity())
def test_ffd_matches_a_plain_first_fit_decreasing(case: tuple[list[int], int]) -> None:
    # The segment tree must choose exactly the bins a linear first-fit scan would.
    lengths, capacity = case
    reference: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, r in enumerate(room) if r >= lengths[i]), None)
        if target is None:
            reference.append([])
            room.append(capacity)
            target = len(room) - 1
        reference[target].append(i)
        room[target] -= lengths[i]
    assert first_fit_decreasing(lengths, capacity) == [sorted(members) for members in reference]


def _next_fit(lengths: list[int], capacity: int) -> int:
    bins, room = 0, 0
    for length in lengths:
        if length > room:
            bins, room = bins + 1, capacity
        room -= length
    return bins


@pytest.mark.parametrize("mix", ["uniform", "short_heavy", "bimodal"])
def test_ffd_is_at_least_as_efficient_as_greedy(mix: str) -> None:
    rng = random.Random(mix)
    capacity = 2048
    for _ in range(20):
        if mix == "uniform":
            lengths = [rng.randint(1, capacity) for _ in range(300)]
        elif mix == "short_heavy":
            lengths = [min(capacity, int(rng.expovariate(1 / 200)) + 1) for _ in range(300)]
        else:
            lengths = [rng.choice([rng.randint(1, 300), rng.randint(1200, capacity)]) for _ in range(300)]
        ffd_rows = len(first_fit_decreasing(lengths, capacity))
        assert packing_efficiency(sum(lengths), ffd_rows, capacity) >= packing_efficiency(
            sum(lengths), _next_fit(lengths, capacity), capacity
        )


def test_ffd_scales_to_many_samples() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 4096) for _ in range(100_000)]
    bins = first_fit_decreasing(lengths, 8192)
    assert sum(len(members) for members in bins) == len(lengths)
    assert packing_efficiency(sum(lengths), len(bins), 8192) > 0.99


@pytest.mark.parametrize(("lengths", "capacity"), [([3, 0], 4), ([5], 4), ([1], 0)])
def test_ffd_rejects_lengths_outside_the_capacity(lengths: list[int], capacity: int) -> None:
    with pytest.raises(ValueError):
        first_fit_decreasing(lengths, capacity)


def test_pack_samples_concatenates_and_restarts_positions() -> None:
    row = pack_samples(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, -100]}]
    )
    assert row == {
        "input_ids": [5, 6, 7, 8, 9],
        "labels": [-100, 6, 7, 8, -100],
        "position_ids": [0, 1, 2, 0, 1],
    }
    assert position_ids_for([3, 2]) == row["position_ids"]
    assert with_position_ids({"input_ids": [4, 4], "labels": [4, 4]})["position_ids"] == [0, 1]
    with pytest.raises(ValueError):
        pack_samples([{"input_ids": [1, 2], "labels": [1]}])


@settings(max_examples=60, deadline=None)
@given(lengths_and_capacity(), st.integers(min_value=1, max_value=300))
def test_pack_table_equals_pack_samples(case: tuple[list[int], int], max_chunk_tokens: int) -> None:
    lengths, capacity = case
    samples = [
        {
            "input_ids": [100 * i + k for k in range(n)],
            "labels": [-100 if k % 2 else 100 * i + k for k in range(n)],
            "position_ids": list(range(n)),
        }
        for i, n in enumerate(lengths)
    ]
    table = pa.Table.from_pylist(samples)
    bins = first_fit_decreasing(lengths, capacity)
    packed = pack_table(table, bins, max_chunk_tokens=max_chunk_tokens).to_pylist()
    assert packed == [pack_samples([samples[i] for i in members]) for members in bins]
    # No token is lost or duplicated.
    assert sorted(t for row in packed for t in row["input_ids"]) == sorted(
        t for s in samples for t in s["input_ids"]
    )


def test_packing_efficiency() -> None:
    assert packing_efficiency(150, 2, 100) == 0.75
    assert packing_efficiency(0, 0, 100) == 0.0
