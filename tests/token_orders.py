"""Legal reorders of an attention reference: the same tokens taken in another order, then put back.

Attention's sums run over tokens: a query's softmax and output over its keys, a key's gradients
over its queries. Taking the queries and keys in another order (the mask following the tokens it
masks) and putting the results back computes the same function with those sums in another order,
so each order is a twin of the reference (tests/numerics.py's :func:`~tests.numerics.assert_float64_twins_rule`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tests.numerics import EPS32, draws_per_tensor, relative_errors

#: The orders of a reference's twins: every second token (0, 2, 4, ..., then 1, 3, 5, ...) and every third (0, 3,
#: 6, ..., then 1, 4, ..., then 2, 5, ...) (:func:`token_order`). An attention twin takes its tokens and its head's
#: features in that order (:func:`take_features`); a batch's rows or a head's vocabulary, those.
#:
#: Why their fp32 results are three draws on any CPU (an argument from structure, not this CPU's measurement): a
#: twin's tensor is the reference's bit for bit only if the kernels group every one of its sums alike in both
#: orders. Kernels group a sum's terms by position: one after another (a chain), neighbours first up a tree, or in
#: lanes of positions ``L`` apart reduced by a tree. The stride-``s`` order puts tokens ``s`` apart at neighbouring
#: positions (but at its ``s - 1`` seams): the reference (stride 1) and its twins (2 and 3) share no neighbours,
#: so a chain or a tree of neighbours groups a sum of 3 live terms or more differently in each. A reversal keeps
#: every token's neighbours and mirrors a symmetric tree, which then adds as before (``+`` commutes): on this CPU
#: the reversed twin this replaced gave test_flash_attn_cpu's window-causal dq (4 live keys, 4 lanes) bit for bit.
#: A roll keeps the order of the keys most causal queries see (the masked ones only move in front of them).
#:
#: Some sums no token order tells apart: 2 live terms (test_zigzag_window's window of 2), or a few small sums
#: that keep their grouping by chance. The features are what makes the draws hold there: every score is a dot
#: product over the head's features (8 or 16 here), which a twin adds in its own order in the forward (q·k) and
#: the backward (dout·v), so every value downstream of a score differs whatever the kernels do with the tokens.
#: Where kernels still add a tensor alike in two orders (a tree whose symmetry a stride matches: on 8 features,
#: stride 3 is p -> 3p mod 8, which a tree pairing lanes 4 apart, then 2, then 1 adds alike; the tokens' orders
#: then still differ), tests/numerics.py's twins rule counts the distinct draws and widens its factor
#: (``TWINS_FACTORS``), and the legality tests name the tensor (:func:`assert_distinct_draws`).
TWIN_ORDERS = ("stride-2", "stride-3")


def token_order(count: int, order: str | None) -> torch.Tensor:
    """The indices of ``count`` tokens in ``order`` (None: their own order; ``"stride-s"``: every ``s``-th token
    from 0, then from 1, ..., then from ``s - 1``)."""
    index = torch.arange(count)
    if order is None:
        return index
    if order in TWIN_ORDERS:
        stride = int(order.removeprefix("stride-"))
        return torch.cat([index[start::stride] for start in range(stride)])
    raise ValueError(f"unknown token order {order!r}; one of {TWIN_ORDERS}")


def take_features(order: str | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The order of ``tensors``' last dimension (q, k and v's: the head's features) in ``order``, and the tensors with
    it taken in that order: the scores' dot products (in the backward also ``dout · v``) then add over the features
    in another order. The output's features go back with ``put_back(out, features, -1)``."""
    features = token_order(tensors[0].shape[-1], order)
    return features, [t[..., features] for t in tensors]


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

    Somewhere, not in every tensor: that every tensor is a draw of its own, among the reference and all its twins,
    is :func:`assert_distinct_draws`' to check.
    """
    errors = relative_errors(twin64, ref64)
    assert max(errors.values()) <= EPS32, f"{what}: another function, relative errors {errors}"
    assert any(not torch.equal(twin32[n], ref32[n]) for n in ref32), f"{what}: bit-identical to the reference"


def assert_distinct_draws(references: Sequence[Mapping[str, torch.Tensor]], what: str = "") -> None:
    """The fp32 reference and its twins (``references``) differ from each other bit for bit in every tensor of more
    than one element: 3 draws of the rounding noise where tests/numerics.py's twins rule counts on 3 (a tensor with
    fewer would take a wider factor, ``TWINS_FACTORS``). Left out: an entry that holds no tensor (a gradient not
    computed), and a scalar: a loss's orders may round to the same float by chance, and it sits under its sum's
    reorder bound (``loss_sum_floor``) anyway."""
    tensors = {name: ref for name, ref in references[0].items() if ref is not None and ref.numel() > 1}
    draws = draws_per_tensor([{name: r[name] for name in tensors} for r in references])
    fewer = {name: n for name, n in draws.items() if n < len(references)}
    assert not fewer, f"{what}: distinct fp32 references per tensor {fewer} of {len(references)}"
