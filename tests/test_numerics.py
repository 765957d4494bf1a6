"""The twins rule's own arithmetic (tests/numerics.py) and its twins' orders (tests/token_orders.py)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.numerics import (
    EPS32,
    FP32_ROUNDOFF,
    FP32_TWINS_FACTOR,
    TWINS_FACTORS,
    assert_float64_twins_rule,
    distinct_draws,
    float64_scalar_twins_excess,
    float64_twins_excess,
)
from tests.token_orders import TWIN_ORDERS, token_order


def false_failure_chance(draws: int, factor: float) -> float:
    """``P_m(c) = E[erf(|X| / (c·√2))^m]``, X standard normal (tests/numerics.py's table), by the trapezoid rule."""
    x = torch.linspace(0, 40, 400_001, dtype=torch.float64)
    y = (
        2
        * torch.exp(-x * x / 2)
        / math.sqrt(2 * math.pi)
        * torch.special.erf(x / (factor * math.sqrt(2))) ** draws
    )
    return float(((y[1:] + y[:-1]) / 2).sum() * (x[1] - x[0]))


def test_each_count_of_draws_takes_the_smallest_factor_with_the_chance_of_3_draws_at_32():
    target = false_failure_chance(3, FP32_TWINS_FACTOR)
    assert target == pytest.approx(2.47e-5, rel=0.01)
    for draws, factor in TWINS_FACTORS.items():
        assert false_failure_chance(draws, factor) <= target * 1.001, draws
        assert false_failure_chance(draws, factor * 0.99) > target, draws  # and no wider than that


def one_off(ref64: torch.Tensor, element: int, by: float) -> torch.Tensor:
    """``ref64`` with one element moved by ``by``: a relative error of ``by / max |ref64|`` (here ``by / 2``)."""
    moved = ref64.clone()
    moved[element] += by
    return moved


def test_a_twin_equal_to_the_reference_is_no_draw_and_widens_the_rule():
    """A path 100x as far from float64 as the references: outside 32x the farthest of 3 draws, inside 161x the
    farthest of 2 (a twin bit-identical to the reference), whatever the errors' values: two distinct tensors with
    equal errors are 2 draws."""
    ref64 = {"t": torch.linspace(1, 2, 64, dtype=torch.float64)}
    reference, path = one_off(ref64["t"], 0, 1e-6), {"t": one_off(ref64["t"], 5, 1e-4)}
    other_twin = one_off(ref64["t"], 2, 0.5e-6)
    same = [{"t": reference}, {"t": reference.clone()}, {"t": other_twin}]
    assert_float64_twins_rule(path, same, ref64)  # 2 draws: 5e-5 / (161 · 5e-7 + 2 ulps) = 0.62
    distinct = [{"t": reference}, {"t": one_off(ref64["t"], 1, 1e-6)}, {"t": other_twin}]  # equal errors
    with pytest.raises(
        AssertionError, match=r"3\.08 times the tolerance \(3 distinct fp32 references: factor 32\)"
    ):
        assert_float64_twins_rule(path, distinct, ref64)


def test_errors_alone_count_their_distinct_values():
    """Without the tensors the rule counts distinct errors; a caller with them says how many."""
    error, floor = 5e-5, 2.4e-7
    assert float64_twins_excess(error, [5e-7, 5e-7, 2.5e-7], floor) == error / (161 * 5e-7 + floor)
    assert float64_twins_excess(error, [5e-7, 5e-7, 2.5e-7], floor, draws=3) == error / (32 * 5e-7 + floor)
    assert float64_twins_excess(error, [5e-7] * 3, floor) == error / (2.6e4 * 5e-7 + floor)


def test_a_scalar_is_counted_by_its_orders_at_its_resolution():
    """A loss whose 3 orders round to one fp32 value is 3 draws known to within half an ulp each, not 1 draw: a
    loss 1e-4 off, 12x its floor, fails; counted by its values (2.6e4 x 6e-8 = 1.6e-3) it would pass."""
    rounding, floor, error = 6e-8, 8.1e-6, 1e-4  # rounding: where float64 fell within the fp32 value's ulp
    u = FP32_ROUNDOFF
    assert u == 2**-24
    excess = float64_scalar_twins_excess(error, [rounding] * 3, floor, draws=3)
    assert excess == error / (32 * (rounding + u) + u + floor) and excess > 1
    assert float64_twins_excess(error, [rounding] * 3, floor) < 1  # what counting its values would allow
    # 2 draws (a twin that reorders nothing, as gpt-oss's): 161; a correct loss a few ulps off passes.
    assert float64_scalar_twins_excess(error, [rounding] * 3, floor, draws=2) == error / (
        161 * (rounding + u) + u + floor
    )
    assert float64_scalar_twins_excess(4 * EPS32, [0.0] * 3, floor, draws=3) < 1
    # Values that differ are draws of their own, whatever the caller's tensors showed.
    assert float64_scalar_twins_excess(
        error, [rounding, 2 * rounding, 3 * rounding], floor, draws=2
    ) == error / (32 * (3 * rounding + u) + u + floor)
    with pytest.raises(AssertionError):
        float64_scalar_twins_excess(error, [rounding] * 2, floor, draws=3)  # more draws than references


def test_draws_are_counted_at_the_values_own_precision():
    """Errors are float64: two that differ below fp32's resolution are 2 draws, not 1 (which would take 161, not 32).
    A NaN equals the NaN at its place in another draw; a reference whose error is NaN is refused, not passed over."""
    error, floor = 5e-5, 2.4e-7
    close = [5e-7, 5e-7 * (1 + 1e-9), 2.5e-7]
    assert distinct_draws(close) == 3
    assert float64_twins_excess(error, close, floor) == error / (32 * max(close) + floor)
    with_nan = torch.tensor([1.0, float("nan"), 3.0])
    assert distinct_draws([with_nan, with_nan.clone(), torch.tensor([1.0, float("nan"), 4.0])]) == 2
    assert distinct_draws([torch.ones(2), torch.ones(1, 2)]) == 2  # another shape: another tensor
    with pytest.raises(AssertionError, match="not finite"):
        float64_twins_excess(error, [5e-7, float("nan"), 2.5e-7], floor)


def neighbours(order: torch.Tensor) -> set[frozenset[int]]:
    """The pairs of tokens at neighbouring positions of ``order``."""
    return {frozenset(pair) for pair in zip(order[:-1].tolist(), order[1:].tolist(), strict=True)}


@pytest.mark.parametrize("count", [5, 8, 11, 12, 13, 16, 20, 35, 64, 97])
def test_the_twin_orders_put_tokens_2_and_3_apart_next_to_each_other(count):
    """tests/token_orders.py's argument: in the stride-s order all neighbours but its s - 1 seams are tokens s
    apart, where the reference's are 1 apart, so a chain or a tree of neighbours groups each sum differently in
    the reference and its 2 twins. A reversal keeps every neighbour (a symmetric tree adds it as before): no twin."""
    own = neighbours(token_order(count, None))
    for order in TWIN_ORDERS:
        tokens = token_order(count, order)
        stride = int(order.removeprefix("stride-"))
        assert sorted(tokens.tolist()) == list(range(count))
        apart = [abs(a - b) for a, b in map(sorted, neighbours(tokens))]
        assert apart.count(stride) == count - stride, order  # every neighbour but the seams
        assert not neighbours(tokens) & own, order
    assert neighbours(token_order(count, None).flip(0)) == own
