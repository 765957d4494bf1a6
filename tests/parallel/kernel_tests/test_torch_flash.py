"""The adapter onto PyTorch's FlashAttention-2, on CPU.

torch's flash-attention ops have no CPU kernels, so the adapter's logic (layouts, LSE shapes
and infinities, in-place gradient writes, masks, GQA, merged-LSE backward) runs here over a
float64 op with the same contract (``benchmarks/gpu/reference_ops.py``), and is compared with the
plain float64 reference and with the CPU stand-ins. Its calls are also bound to the real ops'
schemas of the installed torch on meta tensors. The same checks on the real CUDA ops are
``benchmarks/gpu/check_kernels.py`` (and tests/parallel/kernel_tests/test_torch_flash_gpu.py).

Tolerances (tests/numerics.py): the op computes in float64 and rounds ``out`` and the LSE to fp32
once (a bound, :func:`~tests.numerics.rounding_bound`); gradients, which read the fp32 ``out`` and
LSE, and the fp32 stand-ins follow the twins rule, plain fp32 attention and its 2 twins (the tokens in
other orders, tests/token_orders.py) setting the scale.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from benchmarks.gpu import reference
from benchmarks.gpu.reference_ops import REFERENCE_OPS

from cptune.parallel.kernels import dispatch, flash_attn_cpu, torch_flash
from tests.numerics import assert_float64_twins_rule, assert_within, rounding_bound
from tests.parallel.kernel_tests.dense_reference import varlen_reference
from tests.parallel.kernel_tests.test_flash_attn_cpu import fp32_references
from tests.token_orders import TWIN_ORDERS

HEAD_DIM = 8
KERNELS = {"torch_flash": torch_flash, "stand-in": flash_attn_cpu}


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch) -> Iterator[None]:
    """The adapter calls the float64 reference instead of the CUDA-only ops; one thread for tiny tensors."""
    monkeypatch.setattr(torch_flash, "flash_ops", lambda: REFERENCE_OPS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random(*shapes, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in shapes]


def mask_kwargs(causal, window=(-1, -1)):
    return {"dropout_p": 0.0, "softmax_scale": None, "causal": causal,
            "window_size_left": window[0], "window_size_right": window[1]}  # fmt: skip


def dense(kernels, q, k, v, dout, *, causal, window=(-1, -1)):
    """Forward and backward through one implementation's dense kernels; grads start as NaN."""
    common = mask_kwargs(causal, window) | {"softcap": 0.0, "alibi_slopes": None}
    out, lse, s_dmask, _ = kernels._flash_attn_forward(q, k, v, return_softmax=False, **common)
    assert s_dmask.numel() == 0
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels._flash_attn_backward(dout, q, k, v, out, lse, *grads, deterministic=False, **common)
    return out, lse, grads


DENSE_CASES = {
    "causal": dict(seqlen_q=13, seqlen_k=13, nheads=4, nheads_k=4, causal=True),
    "bidirectional-gqa": dict(seqlen_q=12, seqlen_k=12, nheads=4, nheads_k=2, causal=False),
    "causal-q-shorter": dict(seqlen_q=5, seqlen_k=11, nheads=4, nheads_k=2, causal=True),
    "causal-q-longer-rows-without-keys": dict(seqlen_q=11, seqlen_k=5, nheads=4, nheads_k=1, causal=True),
    "window-causal": dict(seqlen_q=14, seqlen_k=16, nheads=4, nheads_k=2, causal=True, window=(3, -1)),
}


@pytest.mark.parametrize("case", DENSE_CASES.values(), ids=DENSE_CASES.keys())
def test_dense_matches_reference_and_stand_ins(case):
    case = dict(case)
    mask = {"causal": case.pop("causal"), "window": case.pop("window", (-1, -1))}
    b, h, hk = 2, case["nheads"], case["nheads_k"]
    q, k, v, dout = random((b, case["seqlen_q"], h, HEAD_DIM), *[(b, case["seqlen_k"], hk, HEAD_DIM)] * 2,
                           (b, case["seqlen_q"], h, HEAD_DIM))  # fmt: skip
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference.attention(*leaves, **mask)
    ref_out.backward(dout.double())

    results = {name: dense(kernels, q, k, v, dout, **mask) for name, kernels in KERNELS.items()}

    out, lse, _ = results["torch_flash"]
    assert lse.shape == (b, h, case["seqlen_q"]) and lse.dtype == torch.float32
    assert torch.equal(lse.isinf(), ref_lse.isinf()) and torch.all(lse[lse.isinf()] == float("-inf"))
    finite = ~ref_lse.isinf()
    assert_within(out, ref_out, rounding_bound(ref_out), "out")
    assert_within(lse[finite], ref_lse[finite], rounding_bound(ref_lse[finite]), "lse")
    # Both implementations (the stand-ins are what cptune's CPU runs use) near the float64 reference.
    references = [named(*r, finite) for r in fp32_references(q, k, v, dout, **mask)]
    ref64 = named(ref_out, ref_lse, [leaf.grad for leaf in leaves], finite)
    for name, got in results.items():
        assert_float64_twins_rule(named(*got, finite), references, ref64, what=name)


def named(out, lse, grads, finite):
    """Results as the twins rule takes them; rows without keys (lse -inf) left out."""
    return {"out": out, "lse": lse[finite], **dict(zip(("dq", "dk", "dv"), grads, strict=True))}


def test_rows_without_keys_get_minus_inf_lse_zero_output_and_zero_query_gradient():
    """The op writes +inf for rows that see no key; ring-flash-attn's merge needs -inf (see flash_attn_cpu)."""
    q, k, v, dout = random(
        (1, 11, 2, HEAD_DIM), (1, 5, 2, HEAD_DIM), (1, 5, 2, HEAD_DIM), (1, 11, 2, HEAD_DIM)
    )
    raw_lse = REFERENCE_OPS.forward(q, k, v, None, None, 11, 5, 0.0, True, False)[1]
    assert torch.all(raw_lse[:, :, :6] == float("inf"))  # what the CUDA kernel writes

    out, lse, (dq, dk, dv) = dense(torch_flash, q, k, v, dout, causal=True)

    assert torch.all(out[:, :6] == 0) and torch.all(lse[:, :, :6] == float("-inf"))
    assert torch.isfinite(lse[:, :, 6:]).all()
    assert torch.all(dq[:, :6] == 0) and all(torch.isfinite(g).all() for g in (dq, dk, dv))


VARLEN_Q = [0, 7, 20, 31]  # 7, 13, 11 queries
VARLEN_K = [
    0,
    7,
    24,
    35,
]  # 7, 17, 11 keys: llama3's shard layout (a document's queries after its earlier keys)


def varlen(kernels, q, k, v, dout, *, causal, window=(-1, -1), grads=None):
    cu = {"cu_seqlens_q": torch.tensor(VARLEN_Q, dtype=torch.int32),
          "cu_seqlens_k": torch.tensor(VARLEN_K, dtype=torch.int32), "max_seqlen_q": 13, "max_seqlen_k": 17}  # fmt: skip
    common = mask_kwargs(causal, window)
    out, lse, _, _ = kernels._flash_attn_varlen_forward(q, k, v, **cu, **common)
    grads = grads or [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels._flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, **cu, **common,
                                        softcap=0.0, alibi_slopes=None, deterministic=False)  # fmt: skip
    return out, lse, grads


@pytest.mark.parametrize(
    ("nheads_k", "causal", "window"),
    [(2, True, (-1, -1)), (1, False, (-1, -1)), (4, True, (4, -1))],
    ids=["gqa-causal", "mqa-bidirectional", "window-causal"],
)
def test_varlen_matches_reference_and_stand_ins(nheads_k, causal, window):
    q, k, v, dout = random(
        (31, 4, HEAD_DIM), (35, nheads_k, HEAD_DIM), (35, nheads_k, HEAD_DIM), (31, 4, HEAD_DIM)
    )
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference.varlen_attention(*leaves, VARLEN_Q, VARLEN_K, causal=causal, window=window)
    ref_out.backward(dout.double())

    out, lse, grads = varlen(torch_flash, q, k, v, dout, causal=causal, window=window)
    stand_in = varlen(flash_attn_cpu, q, k, v, dout, causal=causal, window=window)

    assert lse.shape == (4, 31) and lse.dtype == torch.float32
    assert_within(out, ref_out, rounding_bound(ref_out), "out")
    assert_within(lse, ref_lse, rounding_bound(ref_lse), "lse")
    every = torch.ones_like(ref_lse, dtype=torch.bool)
    references = [
        named(
            *varlen_reference(q, k, v, dout, VARLEN_Q, VARLEN_K, order, causal=causal, window=window), every
        )
        for order in (None, *TWIN_ORDERS)
    ]
    ref64 = named(ref_out, ref_lse, [leaf.grad for leaf in leaves], every)
    for name, got in (("torch_flash", (out, lse, grads)), ("stand-in", stand_in)):
        assert_float64_twins_rule(named(*got, every), references, ref64, what=name)


def test_backward_writes_into_strided_views_and_nothing_else():
    """ring-flash-attn passes head slices of larger buffers (``dq[:, q_slice]``, ``dkv_buffer[0][k_slice]``)."""
    q, k, v, dout = random((31, 4, HEAD_DIM), (35, 2, HEAD_DIM), (35, 2, HEAD_DIM), (31, 4, HEAD_DIM))
    expected = varlen(torch_flash, q, k, v, dout, causal=True)[2]
    dq_buffer = torch.full((31, 8, HEAD_DIM), 7.0)
    dkv_buffer = torch.full((2, 40, 4, HEAD_DIM), 7.0)
    views = [dq_buffer[:, 1::2], dkv_buffer[0, 5:, 2:], dkv_buffer[1, :-5, :2]]

    varlen(torch_flash, q, k, v, dout, causal=True, grads=views)

    for view, grad in zip(views, expected, strict=True):
        assert torch.equal(view, grad)
    assert torch.all(dq_buffer[:, 0::2] == 7.0)
    assert torch.all(dkv_buffer[0, :5] == 7.0) and torch.all(dkv_buffer[0, 5:, :2] == 7.0)
    assert torch.all(dkv_buffer[1, -5:] == 7.0) and torch.all(dkv_buffer[1, :-5, 2:] == 7.0)


def test_head_slices_of_q_and_a_strided_lse_reach_the_op_in_layouts_it_takes():
    """llama3 hands ``q[:, head slice]`` (strided rows) and zigzag a chunked LSE; the op needs a contiguous LSE."""
    q_wide, k, v, dout = random((31, 8, HEAD_DIM), (35, 2, HEAD_DIM), (35, 2, HEAD_DIM), (31, 4, HEAD_DIM))
    q = q_wide[:, 2:6]
    assert not q.is_contiguous()
    out, lse, grads = varlen(torch_flash, q, k, v, dout, causal=True)
    padded = torch.full((4, 40), 5.0)
    padded[:, :31] = lse
    strided_lse = padded[:, :31]  # same values, rows 40 apart: what a chunked LSE looks like
    cu = {"cu_seqlens_q": torch.tensor(VARLEN_Q, dtype=torch.int32),
          "cu_seqlens_k": torch.tensor(VARLEN_K, dtype=torch.int32), "max_seqlen_q": 13, "max_seqlen_k": 17}  # fmt: skip
    again = [torch.empty_like(t) for t in (q, k, v)]
    torch_flash._flash_attn_varlen_backward(dout, q, k, v, out, strided_lse, *again, **cu, **mask_kwargs(True),
                                            softcap=0.0, alibi_slopes=None, deterministic=False)  # fmt: skip
    for first, second in zip(grads, again, strict=True):
        assert torch.equal(first, second)
    # A head dim with a stride (the kernels refuse it) is made contiguous on the way in.
    q_every_other = torch.stack([q, torch.zeros_like(q)], dim=-1).flatten(-2)[..., ::2]
    assert q_every_other.stride(-1) == 2
    assert torch.equal(varlen(torch_flash, q_every_other, k, v, dout, causal=True)[0], out)


def test_backward_with_merged_output_and_lse_sums_to_the_full_gradient():
    """A ring splits the keys into blocks and runs each block's backward with the *merged* out and LSE."""
    q, k, v, dout = random(
        (1, 8, 4, HEAD_DIM), (1, 16, 2, HEAD_DIM), (1, 16, 2, HEAD_DIM), (1, 8, 4, HEAD_DIM)
    )
    full_out, full_lse, full_grads = dense(torch_flash, q, k, v, dout, causal=False)
    blocks = [slice(0, 10), slice(10, 16)]
    partial = [torch_flash._flash_attn_forward(q, k[:, b], v[:, b], return_softmax=False, softcap=0.0,
                                               alibi_slopes=None, **mask_kwargs(False))[:2] for b in blocks]  # fmt: skip
    merged_lse = torch.logaddexp(partial[0][1], partial[1][1])
    weights = [torch.exp(lse - merged_lse).transpose(1, 2)[..., None] for _, lse in partial]
    merged_out = sum(w * o for w, (o, _) in zip(weights, partial, strict=True))

    dq_total, dk_blocks, dv_blocks = torch.zeros_like(q), [], []
    for b in blocks:
        dq, dk, dv = (torch.empty_like(t) for t in (q, k[:, b], v[:, b]))
        torch_flash._flash_attn_backward(dout, q, k[:, b], v[:, b], merged_out, merged_lse, dq, dk, dv,
                                         softcap=0.0, alibi_slopes=None, deterministic=False,
                                         **mask_kwargs(False))  # fmt: skip
        dq_total += dq
        dk_blocks.append(dk)
        dv_blocks.append(dv)
    # Twins rule: the merge adds fp32 roundings (logaddexp, the weights, the sums) to one call's; the one call
    # and plain fp32 attention in its own and 2 other token orders are the references.
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference.attention(*leaves, causal=False)
    ref_out.backward(dout.double())
    every = torch.ones_like(ref_lse, dtype=torch.bool)
    merged = (merged_out, merged_lse, (dq_total, torch.cat(dk_blocks, 1), torch.cat(dv_blocks, 1)))
    ref64 = (ref_out, ref_lse, [leaf.grad for leaf in leaves])
    references = [
        named(*r, every)
        for r in [(full_out, full_lse, full_grads), *fp32_references(q, k, v, dout, causal=False)]
    ]
    assert_float64_twins_rule(named(*merged, every), references, named(*ref64, every))


@pytest.mark.parametrize(
    ("option", "value"),
    [("dropout_p", 0.1), ("softcap", 30.0), ("alibi_slopes", torch.ones(4)), ("zero_tensors", True)],
)
def test_unsupported_features_raise(option, value):
    q, k, v = random((6, 4, HEAD_DIM), (6, 2, HEAD_DIM), (6, 2, HEAD_DIM))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    kwargs = mask_kwargs(True) | {"softcap": 0.0, "alibi_slopes": None, option: value}
    with pytest.raises(NotImplementedError, match=f"PyTorch's FlashAttention-2 .*{option}"):
        torch_flash._flash_attn_varlen_forward(q, k, v, cu, cu, 6, 6, **kwargs)


def test_an_unexpected_lse_layout_fails_loudly(monkeypatch):
    """A padded (batch, heads, max_seqlen) LSE, as ROCm builds return, must not be used as (heads, total)."""

    def padded_forward(*args, **kwargs):
        out, _, *rest = REFERENCE_OPS.forward(*args, **kwargs)
        return (out, torch.zeros(3, 4, 13), *rest)

    monkeypatch.setattr(
        torch_flash, "flash_ops", lambda: torch_flash.FlashOps(padded_forward, REFERENCE_OPS.backward)
    )
    q, k, v = random((31, 4, HEAD_DIM), (35, 2, HEAD_DIM), (35, 2, HEAD_DIM))
    with pytest.raises(RuntimeError, match=r"shape \(3, 4, 13\).*\(nheads, total_q\) = \(4, 31\)"):
        torch_flash._flash_attn_varlen_forward(q, k, v, torch.tensor(VARLEN_Q, dtype=torch.int32),
                                               torch.tensor(VARLEN_K, dtype=torch.int32), 13, 17, **mask_kwargs(True))  # fmt: skip


# ---- the real ops' schemas ------------------------------------------------------------------


def test_installed_torch_ops_take_every_argument_the_adapter_passes():
    assert torch_flash.missing_schema_arguments() == []


def test_missing_schema_arguments_names_what_an_older_torch_lacks():
    def op(name, *names, kwarg_only=()):
        arguments = [SimpleNamespace(name=n, kwarg_only=False) for n in names]
        arguments += [SimpleNamespace(name=n, kwarg_only=True) for n in kwarg_only]
        return SimpleNamespace(_schema=SimpleNamespace(name=name, arguments=arguments))

    forward = op("aten::_flash_attention_forward", *torch_flash._FORWARD_POSITIONAL, kwarg_only=("scale",))
    backward = op("aten::_flash_attention_backward", *torch_flash._BACKWARD_POSITIONAL[:-1])
    missing = torch_flash.missing_schema_arguments((forward, backward))
    assert missing[:2] == [
        "aten::_flash_attention_forward(..., window_size_left=)",
        "aten::_flash_attention_forward(..., window_size_right=)",
    ]
    assert (
        missing[2].startswith("aten::_flash_attention_backward(grad_out, query")
        and "is_causal, ...)" in missing[2]
    )
    assert "aten::_flash_attention_backward(..., scale=)" in missing


def test_adapter_calls_bind_to_the_installed_ops_on_meta_tensors(monkeypatch):
    """torch registers shape functions for the ops: the adapter's real calls run on meta tensors here."""
    monkeypatch.undo()  # the real ops, not the reference
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q, k, v = torch.empty(31, 4, 64, **meta), torch.empty(35, 2, 64, **meta), torch.empty(35, 2, 64, **meta)
    cu_q, cu_k = (
        torch.empty(4, device="meta", dtype=torch.int32),
        torch.empty(4, device="meta", dtype=torch.int32),
    )
    out, lse, _, _ = torch_flash._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 13, 17, **mask_kwargs(True))
    assert out.shape == q.shape and lse.shape == (4, 31) and lse.dtype == torch.float32
    grads = [torch.empty(t.shape, **meta) for t in (q, k, v)]
    assert torch_flash._flash_attn_varlen_backward(out, q, k, v, out, lse, *grads, cu_q, cu_k, 13, 17,
                                                   **mask_kwargs(True), softcap=0.0, alibi_slopes=None,
                                                   deterministic=False) is None  # fmt: skip
    qd, kd = torch.empty(2, 9, 4, 64, **meta), torch.empty(2, 12, 2, 64, **meta)
    out, lse, _, _ = torch_flash._flash_attn_forward(qd, kd, kd, return_softmax=False, softcap=0.0,
                                                     alibi_slopes=None, **mask_kwargs(False))  # fmt: skip
    assert lse.shape == (2, 4, 9)
    grads = [torch.empty(t.shape, **meta) for t in (qd, kd, kd)]
    torch_flash._flash_attn_backward(out, qd, kd, kd, out, lse, *grads, softcap=0.0, alibi_slopes=None,
                                     deterministic=False, **mask_kwargs(False))  # fmt: skip


def test_not_available_without_cuda():
    torch_flash.unavailable_reason.cache_clear()
    try:
        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present")
        assert torch_flash.unavailable_reason() == "no CUDA device"
        assert not torch_flash.runs(torch.zeros(2, 4, 8, dtype=torch.bfloat16))
    finally:
        torch_flash.unavailable_reason.cache_clear()


# ---- the dispatcher ring-flash-attn imports --------------------------------------------------


def test_dispatcher_signatures_are_flash_attn_2_8s():
    """ring-flash-attn fills arguments by name from ``inspect.getfullargspec`` (ring_flash_attn/utils.py)."""
    for name in ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
                 "_flash_attn_varlen_backward"):  # fmt: skip
        expected = inspect.getfullargspec(getattr(flash_attn_cpu, name))
        assert inspect.getfullargspec(getattr(dispatch, name)) == expected
        assert inspect.getfullargspec(getattr(torch_flash, name)).args == expected.args


def test_dispatcher_sends_cpu_tensors_to_the_stand_ins_and_cuda_half_tensors_to_torch(monkeypatch):
    calls = []
    for name, kernels in KERNELS.items():
        original = kernels._flash_attn_varlen_forward
        monkeypatch.setattr(kernels, "_flash_attn_varlen_forward",
                            lambda *a, _o=original, _n=name, **kw: calls.append(_n) or _o(*a, **kw))  # fmt: skip
    q, k, v = random((31, 4, HEAD_DIM), (35, 2, HEAD_DIM), (35, 2, HEAD_DIM))
    args = (
        q,
        k,
        v,
        torch.tensor(VARLEN_Q, dtype=torch.int32),
        torch.tensor(VARLEN_K, dtype=torch.int32),
        13,
        17,
    )
    dispatch._flash_attn_varlen_forward(*args, **mask_kwargs(True))
    monkeypatch.setattr(torch_flash, "runs", lambda q: True)  # what a CUDA bf16 tensor gets
    dispatch._flash_attn_varlen_forward(*args, **mask_kwargs(True))
    assert calls == ["stand-in", "torch_flash"]


@pytest.mark.parametrize(
    ("q", "runs"),
    [
        (torch.zeros(4, 2, 64, dtype=torch.bfloat16), False),  # CPU
        (torch.zeros(4, 2, 64, dtype=torch.float32, device="meta"), False),
    ],
)
def test_runs_needs_a_cuda_half_tensor(q, runs, monkeypatch):
    monkeypatch.setattr(torch_flash, "unavailable_reason", lambda: None)
    assert torch_flash.runs(q) is runs


def test_llama3_layout_documents_shorter_than_a_shard_and_every_rank(monkeypatch):
    """ring-flash-attn's llama3 arithmetic (prepare_cu_seqlens) on 4 ranks, one process: the adapter
    per rank, with that rank's slice of the gathered keys, equals one attention over the whole row."""
    from cptune.parallel.backends.ring_flash_attn.sharding import load_ring_flash_attn

    prepare = load_ring_flash_attn().prepare_cu_seqlens
    seq_lens, world = [5, 30, 3, 10], 4  # 48 tokens, 12 per rank: documents of 5, 3 and 10 tokens
    cu_seqlens = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32)
    q, k, v = random((48, 4, HEAD_DIM), (48, 2, HEAD_DIM), (48, 2, HEAD_DIM))
    for causal in (True, False):
        ref_out, _ = reference.varlen_attention(
            q, k, v, cu_seqlens.tolist(), cu_seqlens.tolist(), causal=causal
        )
        for rank in range(world):
            cu_q, cu_k, max_q, max_k, k_slice = prepare(cu_seqlens, causal, rank, world)
            rows = slice(12 * rank, 12 * rank + 12)
            out, _, _, _ = torch_flash._flash_attn_varlen_forward(
                q[rows], k[k_slice], v[k_slice], cu_q, cu_k, max_q, max_k, **mask_kwargs(causal)
            )
            assert_within(out, ref_out[rows], rounding_bound(ref_out[rows]))  # one rounding: a bound
