"""Dense attention computed the plain way, per sequence: the reference of the attention kernels' tests.

The CPU flash-attn kernels (test_flash_attn_cpu.py), the adapter onto torch's flash ops (test_torch_flash.py), the
varlen attention in groups of heads (test_varlen_head_groups.py), ring-flash-attn's CP code on gloo
(test_ring_cpu_distributed.py) and the zigzag ring's windows (test_zigzag_window.py's ``dense``) are held against
it: in float64 the reference, in fp32 the reference's draw and, in a twin's token order (tests/token_orders.py),
its twins (tests/numerics.py's twins rule).
"""

from __future__ import annotations

import itertools

import torch

from tests.token_orders import put_back, take_features, token_order


def reference_attention(q, k, v, *, causal, window=(-1, -1), scale=None, order=None):
    """softmax(q k^T * scale + mask) v in the inputs' dtype, dense (b, s, h, d); returns out and lse (b, h, s_q).

    ``order``: None, or one of tests/token_orders.py's ``TWIN_ORDERS``: the queries and keys taken in that order
    (the mask following them), and the head's features, and the results put back, the same function with its sums
    in other orders.
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    q_order, k_order = token_order(seqlen_q, order), token_order(seqlen_k, order)
    features, (q, k, v) = take_features(order, q[:, q_order], k[:, k_order], v[:, k_order])
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    diagonal = q_order[:, None] + seqlen_k - seqlen_q
    key = k_order[None, :]
    left, right = window[0], 0 if causal else window[1]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        visible &= key >= diagonal - left
    if right >= 0:
        visible &= key <= diagonal + right
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without keys: 0, not NaN
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return put_back(put_back(out, q_order, 1), features, -1), put_back(lse, q_order, 2)


def reference_with_grads(q, k, v, dout, order=None, **mask):
    """Reference out, lse and (dq, dk, dv) by autograd, in the inputs' dtype (float64 for the reference);
    ``order``: a twin's token order (``reference_attention``)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(q, k, v, order=order, **mask)
    out.backward(dout)
    return out.detach(), lse.detach(), (q.grad, k.grad, v.grad)


def varlen_reference(q, k, v, dout, cu_q, cu_k, order=None, **mask):
    """Per-sequence dense reference (``reference_with_grads`` of each sequence), concatenated: ``(out, lse, (dq, dk,
    dv))``, tensors ``(total, heads, head_dim)``, lse ``(heads, total_q)``, in the inputs' dtype; ``cu_q``, ``cu_k``:
    the sequences' boundaries (equal for packed documents); ``order``: a twin's (``reference_attention``)."""
    outs, lses, grads = [], [], ([], [], [])
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True):
        out, lse, seq_grads = reference_with_grads(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1], order, **mask
        )
        outs.append(out[0])
        lses.append(lse[0])
        for acc, grad in zip(grads, seq_grads, strict=True):
            acc.append(grad[0])
    return torch.cat(outs), torch.cat(lses, dim=1), [torch.cat(g) for g in grads]
