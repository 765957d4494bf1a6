"""Legal reorders of an attention reference: the same tokens taken in another order, then put back.

Attention's sums run over tokens: a query's softmax and output over its keys, a key's gradients
over its queries. Taking the queries and keys in another order (the mask following the tokens it
masks) and putting the results back computes the same function with those sums in another order,
so each order is a twin of the reference (tests/numerics.py's :func:`~tests.numerics.assert_float64_twins_rule`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tests.numerics import EPS32, relative_errors

#: The orders of a reference's twins: the tokens reversed, and the even-numbered ones first. Not rolled: under a
#: causal mask a roll keeps the order of the keys most queries see (the masked ones only move in front of them).
TWIN_ORDERS = ("reversed", "evens-first")


def token_order(count: int, order: str | None) -> torch.Tensor:
    """The indices of ``count`` tokens in ``order`` (None: their own order)."""
    index = torch.arange(count)
    if order is None:
        return index
    if order == "reversed":
        return index.flip(0)
    if order == "evens-first":
        return torch.cat([index[0::2], index[1::2]])
    raise ValueError(f"unknown token order {order!r}; one of {TWIN_ORDERS}")


def put_back(tensor: torch.Tensor, order: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor``, whose ``dim`` was taken in ``order``, in the tokens' own order again (a gather: exact)."""
    return tensor.index_select(dim, torch.argsort(order))


def assert_legal_twin(
    twin64: Mapping[str, torch.Tensor],
    ref64: Mapping[str, torch.Tensor],
    twin32: Mapping[str, torch.Tensor],
    ref32: Mapping[str, torch.Tensor],
    what: str = "",
) -> None:
    """A twin computes the reference's function with its sums in another order.

    In float64 every tensor of the twin lands within fp32's resolution (``EPS32`` of the tensor's largest
    element) of the reference's: float64 evaluations of these sums (at most a few hundred terms) in two orders
    differ by about 1e-14 of it, where a twin of another function (a mask off by a key, a token put back in the
    wrong place) differs by far more than fp32's rounding, and would widen the twins rule's limit enough to let
    bugs through. In fp32 the twin differs from the reference somewhere: a draw of the noise of its own.

    Somewhere, not in every tensor, and on this CPU only: a tensor whose sums the order leaves alike (as the
    kernel adds them) is no draw of its own, and its twins rule rests on one draw fewer. On this CPU the reversed
    twin gives the reference's fp32 dq bit for bit in test_flash_attn_cpu's window-causal case (4 live keys a
    query, which a kernel adding in pairs sums as (a+b)+(c+d) reversed or not), and the loss in
    test_memory_features' reversed-vocabulary twin (a loss sits under its own floor, so that one costs nothing).
    """
    errors = relative_errors(twin64, ref64)
    assert max(errors.values()) <= EPS32, f"{what}: another function, relative errors {errors}"
    assert any(not torch.equal(twin32[n], ref32[n]) for n in ref32), f"{what}: bit-identical to the reference"
