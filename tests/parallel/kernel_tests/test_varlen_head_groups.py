"""cptune's varlen attention called a few KV heads at a time (``kv_heads_per_call``): the same attention.

Heads are independent, so splitting them over calls changes no head's arithmetic in the attention
itself; on the CPU's stand-in kernels the batched matrix products run over other batch counts, so
gradients may differ in the last bits: both are held to the twins rule (tests/numerics.py), the one call and
plain fp32 attention per sequence in 2 token orders (tests/token_orders.py) the references, and a call
that mixed up heads (a wrong group's keys) fails it. The GPU kernels' bit-identity is
``benchmarks/gpu/check_kernels.py``'s to check on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from cptune.parallel.kernels import varlen
from cptune.parallel.kernels.varlen import _head_groups, varlen_attention
from tests.numerics import assert_float64_twins_rule
from tests.parallel.kernel_tests.dense_reference import varlen_reference
from tests.token_orders import TWIN_ORDERS

CU_SEQLENS = torch.tensor([0, 7, 25, 40], dtype=torch.int32)


def attention(q, k, v, causal, per_call):
    out = varlen_attention(q, k, v, CU_SEQLENS, 18, scale=None, causal=causal, kv_heads_per_call=per_call)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1]))
    return dict(zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True))


def references(fp32, whole, causal):
    """``whole`` (the attention in one call) and plain fp32 attention per sequence in 2 other token orders."""
    cu = CU_SEQLENS.tolist()
    dout = torch.ones_like(whole["out"]) * torch.linspace(-1, 1, whole["out"].shape[-1])
    q, k, v = (t.detach() for t in fp32)
    twins = [varlen_reference(q, k, v, dout, cu, cu, order, causal=causal) for order in TWIN_ORDERS]
    return [
        whole,
        *(dict(zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True)) for out, _, grads in twins),
    ]


def inputs(heads=8, kv_heads=4):
    """q, k, v in fp32, and the same values in float64 for the reference."""
    torch.manual_seed(0)
    fp32 = [torch.randn(40, n, 16) for n in (heads, kv_heads, kv_heads)]
    return [t.requires_grad_() for t in fp32], [t.double().requires_grad_() for t in fp32]


def test_the_head_groups_cover_every_head_once():
    q, k = torch.empty(3, 8, 4), torch.empty(3, 4, 4)
    assert _head_groups(q, k, 1) == [(slice(0, 2), slice(0, 1)), (slice(2, 4), slice(1, 2)),
                                     (slice(4, 6), slice(2, 3)), (slice(6, 8), slice(3, 4))]  # fmt: skip
    assert _head_groups(q, k, 3) == [(slice(0, 6), slice(0, 3)), (slice(6, 8), slice(3, 4))]
    assert _head_groups(q, k, 0) == _head_groups(q, k, 4) == [(slice(0, 8), slice(0, 4))]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("per_call", [1, 3])
def test_groups_of_kv_heads_give_the_attention_of_one_call(causal, per_call):
    fp32, fp64 = inputs()
    whole = attention(*fp32, causal, None)
    grouped = attention(*fp32, causal, per_call)
    ref64 = attention(*fp64, causal, None)
    assert torch.equal(grouped["out"], whole["out"])  # the forward runs the same arithmetic per head
    assert_float64_twins_rule(
        grouped, references(fp32, whole, causal), ref64, what=f"kv_heads_per_call={per_call}"
    )


def test_a_group_given_another_groups_keys_fails_the_rule(monkeypatch):
    """The comparison sees heads mixed up: every group attends with the first group's keys and values."""
    fp32, fp64 = inputs()
    whole, ref64 = attention(*fp32, True, None), attention(*fp64, True, None)
    twins = references(fp32, whole, True)
    right = varlen._head_groups
    monkeypatch.setattr(
        varlen,
        "_head_groups",
        lambda q, k, n: [(qs, slice(0, ks.stop - ks.start)) for qs, ks in right(q, k, n)],
    )
    with pytest.raises(AssertionError, match="times the tolerance"):
        assert_float64_twins_rule(attention(*fp32, True, 1), twins, ref64, what="heads mixed up")
