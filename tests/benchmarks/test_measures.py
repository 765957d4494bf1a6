"""The pure arithmetic of the benchmarks: budget search, attention-pair counts, memory replay, packers."""

from __future__ import annotations

import pytest
import torch
from benchmarks.balance import causal_pairs, imbalance, packed_rows
from benchmarks.budget_search import affine_fit, bracket, next_probe
from benchmarks.data_bench import next_fit, packing_table, padded_to_longest
from benchmarks.memtrace import AllocationTrace, replay
from benchmarks.synthetic import LENGTH_MIXES

from cptune.svg import bar_chart


def search(
    cost, budget: float, grid: int, first: int, max_probes: int = 20
) -> tuple[dict[int, float], int | None]:
    measured: dict[int, float] = {}
    length: int | None = first
    while length is not None and len(measured) < max_probes:
        measured[length] = cost(length)
        length = next_probe(measured, budget, grid)
    return measured, bracket(measured, budget)[0]


@pytest.mark.parametrize("first", [128, 512, 4096])
def test_budget_search_finds_the_longest_fitting_grid_length_of_an_affine_cost(first):
    cost = lambda s: 1000 + 37.5 * s  # noqa: E731
    measured, longest = search(cost, budget=100_000, grid=128, first=first)
    assert longest == 2560  # 1000 + 37.5 * 2560 = 97,000; 2688 costs 101,800
    assert cost(longest + 128) > 100_000
    assert len(measured) <= 7  # at most doubling per probe from 128, then two to bracket


def test_budget_search_brackets_a_nonlinear_cost_and_reports_when_nothing_fits():
    cost = lambda s: s * s  # noqa: E731
    _, longest = search(cost, budget=10_000**2, grid=100, first=200)
    assert longest == 10_000
    measured, longest = search(lambda s: 1e9, budget=1.0, grid=64, first=640)
    assert longest is None and min(measured) == 64


def test_budget_search_never_jumps_more_than_the_growth_limit():
    assert next_probe({100: 1.0}, budget=1e6, grid=100) == 200


def test_affine_fit_recovers_a_line():
    intercept, slope = affine_fit({1: 5.0, 3: 11.0, 10: 32.0})
    assert intercept == pytest.approx(2.0) and slope == pytest.approx(3.0)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_contiguous_causal_work_is_imbalanced_as_2n_minus_1_over_n_and_zigzag_is_balanced(cp):
    length = 1024
    contiguous = causal_pairs(length, cp, "contiguous")
    zigzag = causal_pairs(length, cp, "zigzag")
    total = length * (length + 1) // 2
    assert sum(contiguous) == sum(zigzag) == total
    assert imbalance(contiguous) == pytest.approx((2 * cp - 1) / cp, rel=2e-3)
    assert imbalance(zigzag) == pytest.approx(1.0, abs=1e-3)


def test_packed_documents_restart_the_causal_count():
    # Two documents of 4: each query sees its position + 1 keys of its own document only.
    assert causal_pairs(8, 2, "contiguous", [4, 4]) == [10, 10]
    rows = packed_rows(100, [60, 50, 40, 30], multiple=8)
    assert all(sum(docs) % 8 == 0 for docs in rows) and len(rows) == 2


def test_replay_splits_the_peak_between_kernel_workspace_and_the_rest():
    memory = [(1, 100), (3, 500), (4, -500), (5, 40), (7, 10), (8, -60)]
    kernels = [(2, 6)]  # allocates 500 of scratch, leaves 40 behind
    result = replay(memory, kernels)
    assert result.peak == 600
    assert result.kernel_workspace == 500
    assert result.peak_outside_kernels == 150  # 100 + 40 after the kernel, + 10
    assert result.net == 90


def test_a_trace_ignores_the_free_of_a_block_an_earlier_trace_allocated():
    """torch's CPU reporter remembers every block allocated under any memory trace; freed under a later
    one, it used to count as a negative allocation and lower that trace's peak (a CI failure of the
    memory model's trace test, after earlier tests' blocks were collected mid-step)."""
    with AllocationTrace():
        earlier = torch.ones(1 << 20)  # 4 MiB, alive when the next trace begins
    with AllocationTrace() as trace:
        del earlier
        step = torch.ones(1 << 18)  # 1 MiB
        del step
    assert trace.result.peak == 1 << 20
    assert trace.result.net == 0


def test_next_fit_opens_a_row_whenever_the_next_sample_does_not_fit():
    assert next_fit([6, 5, 4, 3, 2], capacity=10) == [[0], [1, 2], [3, 4]]
    assert padded_to_longest([1, 4, 2, 2], batch=2) == 8 + 4


def test_first_fit_decreasing_packs_the_instruction_mix_fuller_than_the_alternatives():
    mix = LENGTH_MIXES[0]
    table = packing_table(mix.sample(500, seed=0), mix.sequence_len)
    efficiency = {name: entry["efficiency"] for name, entry in table.items()}
    ffd = efficiency.pop("first-fit-decreasing (cptune)")
    assert all(ffd >= other for other in efficiency.values())
    assert all(0 < e <= 1 for e in [ffd, *efficiency.values()])


def test_length_mixes_are_deterministic_and_within_the_row():
    for mix in LENGTH_MIXES:
        lengths = mix.sample(200, seed=4)
        assert lengths == mix.sample(200, seed=4)
        assert all(8 <= n <= mix.sequence_len for n in lengths)


def test_bar_chart_is_a_standalone_svg_with_one_bar_per_value():
    svg = bar_chart("t", ["a", "b"], {"x": [1.0, 2.0], "y": [0.5, 0.0]}, "MiB")
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert svg.count("<rect") == 1 + 4 + 2  # background, bars, legend
