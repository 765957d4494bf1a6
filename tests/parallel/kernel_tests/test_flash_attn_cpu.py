"""The CPU flash-attn kernels against a float64 reference; the shim that lets ring-flash-attn import them.

fp32: the twins rule (tests/numerics.py), the same attention computed the plain way in fp32 and in
2 other token orders (tests/token_orders.py) setting the scale. bf16: a bound, each result the fp32 kernels' rounded once.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import sys
from collections.abc import Iterator

import pytest
import torch

from cptune.parallel.kernels import (
    blockwise,
    flash_attn_available,
    flash_attn_shim_patches,
    shim_modules,
)
from cptune.parallel.kernels.flash_attn_cpu import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)
from tests.numerics import EPS_BF16, assert_float64_twins_rule, assert_within, reorder_bound
from tests.parallel.kernel_tests.dense_reference import reference_with_grads, varlen_reference
from tests.token_orders import TWIN_ORDERS, assert_distinct_draws, assert_legal_twin

HEAD_DIM = 8


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These tensors are tiny: a second intra-op thread only adds OpenMP barrier waits on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, HEAD_DIM), *[(batch, seqlen_k, nheads_k, HEAD_DIM)] * 2]
    q, k, v = (torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes)
    dout = torch.randn(q.shape, generator=generator, dtype=torch.float64)
    return q, k, v, dout


def fp32_references(q, k, v, dout, **mask):
    """The plain fp32 reference and its twins (the tokens in ``TWIN_ORDERS``), each ``(out, lse, grads)``."""
    fp32 = [t.float() for t in (q, k, v, dout)]
    return [reference_with_grads(*fp32, order=order, **mask) for order in (None, *TWIN_ORDERS)]


def assert_near_float64(got, q, k, v, dout, mask, *, ref64=None, what=""):
    """fp32 ``(out, lse, (dq, dk, dv), softmax_d)`` under the twins rule (tests/numerics.py).

    The same attention computed the plain way in fp32 and its 2 twins (``fp32_references``) set the
    scale; ``ref64``: the float64 reference's ``(out, lse, grads)`` when the caller has them. Rows
    without a visible key have lse -inf in both.
    """
    out, lse, grads, softmax_d = got
    ref64 = ref64 or reference_with_grads(q, k, v, dout, **mask)
    references = fp32_references(q, k, v, dout, **mask)
    finite = torch.isfinite(ref64[1])
    assert lse.dtype == torch.float32 and torch.equal(lse[~finite], ref64[1][~finite].float())

    def named(out, lse, grads, dout):
        return {"out": out, "lse": lse[finite], **dict(zip(("dq", "dk", "dv"), grads, strict=True)),
                "softmax_d": (dout * out).sum(-1).transpose(-1, -2)}  # fmt: skip

    got_d = named(out, lse, grads, dout.float())
    got_d["softmax_d"] = softmax_d  # the kernel's own delta, against the references' dout . out
    twins = [named(*r, dout.float()) for r in references]
    assert_float64_twins_rule(got_d, twins, named(*ref64, dout), what=what)


def run_dense(q, k, v, dout, *, dtype, causal, window=(-1, -1), backward_out=None):
    """Forward and backward through the dense kernels in ``dtype``; the backward reads ``backward_out`` if given."""
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    common = {"dropout_p": 0.0, "softmax_scale": HEAD_DIM**-0.5, "causal": causal}
    common |= {"window_size_left": window[0], "window_size_right": window[1]}
    common |= {"softcap": 0.0, "alibi_slopes": None}
    out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, return_softmax=False, **common)
    assert s_dmask.numel() == 0 and rng_state.shape == (2,)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    read = out if backward_out is None else backward_out.to(dtype)
    softmax_d = _flash_attn_backward(dout, q, k, v, read, lse, *grads, deterministic=False, **common)
    return out, lse, grads, softmax_d


DENSE_CASES = {
    "causal": dict(seqlen_q=13, seqlen_k=13, nheads=4, nheads_k=4, causal=True),
    "non-causal": dict(seqlen_q=13, seqlen_k=13, nheads=4, nheads_k=4, causal=False),
    "gqa-2kv-causal": dict(seqlen_q=12, seqlen_k=12, nheads=4, nheads_k=2, causal=True),
    "gqa-1kv-non-causal": dict(seqlen_q=12, seqlen_k=12, nheads=4, nheads_k=1, causal=False),
    "causal-q-shorter": dict(seqlen_q=5, seqlen_k=11, nheads=4, nheads_k=2, causal=True),
    "causal-q-longer": dict(seqlen_q=11, seqlen_k=5, nheads=4, nheads_k=2, causal=True),
    "non-causal-q-shorter": dict(seqlen_q=5, seqlen_k=11, nheads=4, nheads_k=1, causal=False),
    "window-causal": dict(seqlen_q=14, seqlen_k=16, nheads=4, nheads_k=2, causal=True, window=(3, -1)),
    "window-both-sides": dict(seqlen_q=14, seqlen_k=14, nheads=4, nheads_k=2, causal=False, window=(2, 1)),
    "window-right-only": dict(seqlen_q=9, seqlen_k=14, nheads=4, nheads_k=4, causal=False, window=(-1, 0)),
}


@pytest.mark.parametrize("case", DENSE_CASES.values(), ids=DENSE_CASES.keys())
def test_dense_matches_reference_in_fp32(case):
    case = dict(case)
    mask = {"causal": case.pop("causal"), "window": case.pop("window", (-1, -1))}
    q, k, v, dout = random_qkv(batch=2, **case)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, **mask)

    got = run_dense(q, k, v, dout, dtype=torch.float32, **mask)

    assert got[0].dtype == torch.float32 and got[1].shape == (2, case["nheads"], case["seqlen_q"])
    assert_near_float64(got, q, k, v, dout, mask, ref64=(ref_out, ref_lse, ref_grads))


@pytest.mark.parametrize("case", DENSE_CASES.values(), ids=DENSE_CASES.keys())
def test_the_twin_orders_compute_the_reference_function_in_another_order(case):
    """The fp32 references' twins (``fp32_references``) are legal: the same function, a noise of their own in every
    tensor (``assert_distinct_draws``)."""
    case = dict(case)
    mask = {"causal": case.pop("causal"), "window": case.pop("window", (-1, -1))}
    q, k, v, dout = random_qkv(batch=2, **case)

    def named(out, lse, grads):
        finite = torch.isfinite(lse)  # rows without keys: -inf in every order (the kernels' test checks it)
        return {"out": out, "lse": lse[finite], **dict(zip(("dq", "dk", "dv"), grads, strict=True))}

    ref64, ref32 = (named(*reference_with_grads(*t, **mask)) for t in ((q, k, v, dout), fp32(q, k, v, dout)))
    twins32 = []
    for order in TWIN_ORDERS:
        twin64 = named(*reference_with_grads(q, k, v, dout, order, **mask))
        twins32.append(named(*reference_with_grads(*fp32(q, k, v, dout), order, **mask)))
        assert_legal_twin(twin64, ref64, twins32[-1], ref32, what=order)
    assert_distinct_draws([ref32, *twins32])


def fp32(*tensors):
    return [t.float() for t in tensors]


def test_rows_without_keys_give_zero_output_and_minus_inf_lse():
    # Bottom-right causal with seqlen_q > seqlen_k: the first 6 queries see no key.
    q, k, v, dout = random_qkv(batch=1, seqlen_q=11, seqlen_k=5, nheads=2, nheads_k=2)
    out, lse, grads, _ = run_dense(q, k, v, dout, dtype=torch.float32, causal=True)
    assert torch.all(out[:, :6] == 0) and torch.all(lse[:, :, :6] == float("-inf"))
    assert torch.isfinite(lse[:, :, 6:]).all()
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert torch.all(grads[0][:, :6] == 0)


def qkv_with_large_scores(nheads_k: int, seqlen: int, offset: float = 1000.0):
    """fp32 q, k, v (``seqlen`` tokens, 4 query heads; v all ones) whose scores are ``offset`` plus O(1) on every
    query row: every key carries the same first feature, every query one near ``offset / (scale * that)``."""
    q, k, _, _ = (t[0].float() for t in random_qkv(1, seqlen, seqlen, nheads=4, nheads_k=nheads_k, seed=3))
    shared = offset**0.5 * HEAD_DIM**0.25  # q_0 * k_0 * scale = offset on average
    k[..., 0] = shared
    q[..., 0] += shared
    return q, k, torch.ones_like(k)


@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_each_row_of_weights_sums_to_one_when_the_scores_are_large(layout):
    """Attention over values all 1 returns 1: each query's weights sum to 1, however large its scores.

    Bound: the kernel divides the sum of a row's weights times 1 by the sum of the same weights: two sums of the
    same ``keys`` terms, each within ``γ_keys`` of their exact sum, and one division (``u``), so within
    ``reorder_bound(keys + 1, 1)``. With the scores near 1000, weights ``exp(score - lse)`` (the kernel before)
    would put lse's rounding, half an ulp of 1000 (3e-5), into every output of the row.
    """
    seqlen, keys = VARLEN_K[-1], max(b - a for a, b in itertools.pairwise(VARLEN_K))
    q, k, v = qkv_with_large_scores(nheads_k=2, seqlen=seqlen)
    common = {"dropout_p": 0.0, "softmax_scale": HEAD_DIM**-0.5, "causal": False}
    if layout == "dense":
        keys = seqlen
        out, lse, _, _ = _flash_attn_forward(
            q[None], k[None], v[None], window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, return_softmax=False, **common,
        )  # fmt: skip
    else:
        cu = torch.tensor(VARLEN_K, dtype=torch.int32)
        out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu, cu, keys, keys, **common)
    assert lse.min() > 900  # the case this test is about: |lse| in the hundreds
    assert_within(out, torch.ones_like(out), reorder_bound(keys + 1, 1.0), f"{layout} out of values all 1")


def assert_bf16_is_fp32_rounded_once(bf16, fp32) -> None:
    """Bound: bf16 results ``(out, lse, grads)`` within one bf16 rounding (u = eps / 2) of fp32 ones.

    The kernels compute in fp32 and round each result to bf16 once; ``fp32`` must be the fp32
    kernels run on the same bf16 inputs, their backward reading the bf16 output (as the bf16
    backward does, like flash-attn's). The lse is fp32 in both: the same.
    """
    (out, lse, grads), (out32, lse32, grads32) = bf16, fp32
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert all(grad.dtype == torch.bfloat16 for grad in grads)
    assert torch.equal(lse, lse32)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (out32, *grads32), strict=True):
        assert_within(got, want, EPS_BF16 / 2 * want.abs(), name)


def test_dense_bf16_is_the_fp32_result_rounded_once():
    q, k, v, dout = random_qkv(batch=2, seqlen_q=16, seqlen_k=16, nheads=4, nheads_k=2)
    q, k, v, dout = (t.to(torch.bfloat16) for t in (q, k, v, dout))
    out, lse, grads, _ = run_dense(q, k, v, dout, dtype=torch.bfloat16, causal=True)
    out32, lse32, grads32, _ = run_dense(q, k, v, dout, dtype=torch.float32, causal=True, backward_out=out)
    assert_bf16_is_fp32_rounded_once((out, lse, grads), (out32, lse32, grads32))


def test_blocked_computation_equals_single_block(monkeypatch):
    """Long inputs are split into query blocks with narrowed key ranges; results must not change.

    Narrower key ranges and dk, dv added block by block: the same sums in another order, so both
    are held to the twins rule.
    """
    q, k, v, dout = random_qkv(batch=1, seqlen_q=23, seqlen_k=29, nheads=4, nheads_k=2)
    for mask in ({"causal": True}, {"causal": False, "window": (4, 2)}, {"causal": True, "window": (3, -1)}):
        whole = run_dense(q, k, v, dout, dtype=torch.float32, **mask)
        monkeypatch.setattr(blockwise, "_MAX_SCORE_ELEMENTS", 4 * 29 * 3)  # 3 query rows per block
        blocked = run_dense(q, k, v, dout, dtype=torch.float32, **mask)
        monkeypatch.undo()
        for got in (whole, blocked):
            assert_near_float64(got, q, k, v, dout, mask, what=str(mask))


VARLEN_Q = [0, 7, 20, 31]  # three sequences of 7, 13 and 11 queries
VARLEN_K = [0, 7, 24, 35]  # 7, 17 and 11 keys: the middle one has more keys than queries


def run_varlen(q, k, v, dout, *, causal, window=(-1, -1), dq=None, dk=None, dv=None, backward_out=None):
    cu_q, cu_k = torch.tensor(VARLEN_Q, dtype=torch.int32), torch.tensor(VARLEN_K, dtype=torch.int32)
    seq = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 13, "max_seqlen_k": 17}
    common = {"dropout_p": 0.0, "softmax_scale": None, "causal": causal}
    common |= {"window_size_left": window[0], "window_size_right": window[1]}
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, **seq, **common)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    common |= {"softcap": 0.0, "alibi_slopes": None, "deterministic": True}
    read = out if backward_out is None else backward_out.to(q.dtype)
    softmax_d = _flash_attn_varlen_backward(dout, q, k, v, read, lse, dq, dk, dv, **seq, **common)
    return out, lse, (dq, dk, dv), softmax_d


@pytest.mark.parametrize(
    ("nheads_k", "mask"),
    [(2, {"causal": True}), (1, {"causal": False}), (4, {"causal": True, "window": (4, -1)})],
    ids=["gqa-causal", "mqa-non-causal", "window-causal"],
)
def test_varlen_matches_per_sequence_reference_in_fp32(nheads_k, mask):
    q, k, v, dout = (t[0] for t in random_qkv(1, VARLEN_Q[-1], VARLEN_K[-1], nheads=4, nheads_k=nheads_k))
    ref_out, ref_lse, ref_grads = varlen_reference(q, k, v, dout, VARLEN_Q, VARLEN_K, **mask)

    got = run_varlen(*(t.float() for t in (q, k, v, dout)), **mask)

    assert got[1].shape == (4, VARLEN_Q[-1]) and got[1].dtype == torch.float32
    fp32 = [t.float() for t in (q, k, v, dout)]
    references = [
        varlen_reference(*fp32, VARLEN_Q, VARLEN_K, order, **mask) for order in (None, *TWIN_ORDERS)
    ]
    assert_varlen_near_float64(got, (ref_out, ref_lse, ref_grads), references, dout)


def assert_varlen_near_float64(got, ref64, references, dout) -> None:
    """``assert_near_float64`` for the varlen layout (lse ``(h, total)``, delta ``(h, total)``)."""
    out, lse, grads, softmax_d = got

    def named(out, lse, grads):
        return {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads, strict=True)),
                "softmax_d": (dout.to(out.dtype) * out).sum(-1).T}  # fmt: skip

    got_d = named(out, lse, grads) | {"softmax_d": softmax_d}
    assert_float64_twins_rule(got_d, [named(*r) for r in references], named(*ref64))


def test_varlen_bf16_is_the_fp32_result_rounded_once():
    q, k, v, dout = (t[0].to(torch.bfloat16) for t in random_qkv(1, VARLEN_Q[-1], VARLEN_K[-1], 4, 2))
    out, lse, grads, _ = run_varlen(q, k, v, dout, causal=True)
    out32, lse32, grads32, _ = run_varlen(
        *(t.float() for t in (q, k, v, dout)), causal=True, backward_out=out
    )
    assert_bf16_is_fp32_rounded_once((out, lse, grads), (out32, lse32, grads32))


def test_backward_writes_into_strided_views_and_nothing_else():
    """ring-flash-attn hands slices of larger buffers (e.g. ``dq_buffer[:, :seqlen_q]``) as dq/dk/dv."""
    q, k, v, dout = (t[0].float() for t in random_qkv(1, VARLEN_Q[-1], VARLEN_K[-1], nheads=4, nheads_k=2))
    expected = run_varlen(q, k, v, dout, causal=True)[2]
    # Head-interleaved views of wider buffers, the way ring-flash-attn slices heads_k_stride heads.
    dq_buffer = torch.full((q.shape[0], 8, HEAD_DIM), 7.0)
    dkv_buffer = torch.full((2, k.shape[0] + 5, 4, HEAD_DIM), 7.0)
    views = (dq_buffer[:, 1::2], dkv_buffer[0, 5:, 2:], dkv_buffer[1, :-5, :2])
    assert not any(view.is_contiguous() for view in views)

    run_varlen(q, k, v, dout, causal=True, dq=views[0], dk=views[1], dv=views[2])

    for view, grad in zip(views, expected, strict=True):
        torch.testing.assert_close(view, grad, atol=0, rtol=0)
    assert torch.all(dq_buffer[:, 0::2] == 7.0)
    assert torch.all(dkv_buffer[0, :5] == 7.0) and torch.all(dkv_buffer[0, 5:, :2] == 7.0)
    assert torch.all(dkv_buffer[1, -5:] == 7.0) and torch.all(dkv_buffer[1, :-5, 2:] == 7.0)


def test_signatures_match_flash_attn_2_8():
    """ring-flash-attn fills these by name from ``inspect.getfullargspec`` (ring_flash_attn/utils.py)."""
    forward = ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right"]
    forward += ["softcap", "alibi_slopes", "return_softmax"]
    varlen_forward = [*forward[:3], "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    varlen_forward += [*forward[3:], "block_table", "leftpad_k", "seqused_k", "zero_tensors"]
    backward = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", *forward[3:10]]
    backward += ["deterministic", "rng_state"]
    varlen_backward = [*backward[:9], *varlen_forward[3:7], *backward[9:], "zero_tensors"]
    expected = {
        _flash_attn_forward: (forward, {}),
        _flash_attn_varlen_forward: (varlen_forward, {"window_size_left": -1, "window_size_right": -1}),
        _flash_attn_backward: (backward, {"rng_state": None}),
        _flash_attn_varlen_backward: (varlen_backward, {"rng_state": None, "zero_tensors": False}),
    }
    for function, (names, some_defaults) in expected.items():
        spec = inspect.getfullargspec(function)
        assert spec.args == names and not spec.kwonlyargs and spec.varargs is None
        defaults = dict(zip(reversed(spec.args), reversed(spec.defaults or ()), strict=False))
        assert some_defaults.items() <= defaults.items()


@pytest.mark.parametrize(
    ("option", "value"),
    [("dropout_p", 0.1), ("softcap", 30.0), ("alibi_slopes", torch.ones(4)), ("return_softmax", True)],
)
def test_unsupported_features_raise(option, value):
    q, k, v, _ = (t.float() for t in random_qkv(1, 4, 4, nheads=4, nheads_k=2))
    kwargs = {"dropout_p": 0.0, "softmax_scale": None, "causal": True, "window_size_left": -1}
    kwargs |= {"window_size_right": -1, "softcap": 0.0, "alibi_slopes": None, "return_softmax": False}
    with pytest.raises(NotImplementedError, match=option):
        _flash_attn_forward(q, k, v, **(kwargs | {option: value}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cu_seqlens_q": torch.tensor([0, 4], dtype=torch.int64)}, "int32"),
        ({"max_seqlen_k": 3}, "max_seqlen_k"),
        ({"cu_seqlens_k": torch.tensor([0, 9], dtype=torch.int32)}, "cu_seqlens_k"),
        ({"k": torch.zeros(4, 3, HEAD_DIM)}, "multiple of nheads_k"),
        ({"block_table": torch.zeros(1, 1, dtype=torch.int32)}, "block_table"),
    ],
)
def test_varlen_rejects_bad_arguments(change, message):
    q, k, v = torch.zeros(4, 4, HEAD_DIM), torch.zeros(4, 2, HEAD_DIM), torch.zeros(4, 2, HEAD_DIM)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    kwargs = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 4}
    kwargs |= {"max_seqlen_k": 4, "dropout_p": 0.0, "softmax_scale": None, "causal": False}
    if "k" in change:
        kwargs["v"] = change["k"]
    with pytest.raises((ValueError, NotImplementedError), match=message):
        _flash_attn_varlen_forward(**(kwargs | change))


# ---- the shim -------------------------------------------------------------------------------


@pytest.fixture
def ring_flash_attn() -> Iterator[object]:
    """A fresh ``import ring_flash_attn`` through the shim; restores sys.modules and transformers after.

    Any ring_flash_attn modules imported earlier in the session are set aside and put back, so
    the import really runs here and other tests keep their module objects.
    """
    import transformers.modeling_flash_attention_utils as fa_utils

    if flash_attn_available():
        pytest.skip("flash-attn is installed: the shim is not used")
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.startswith("ring_flash_attn")}
    had_flag = hasattr(fa_utils, "is_flash_attn_greater_or_equal_2_10")
    if not had_flag:  # removed in transformers 5.x; ring_flash_attn/adapters/hf_adapter.py:9-17 imports it
        fa_utils.is_flash_attn_greater_or_equal_2_10 = True
    modules = shim_modules()
    sys.modules.update(modules)
    try:
        module = importlib.import_module("ring_flash_attn")
        yield module
    finally:
        for name in modules:
            sys.modules.pop(name, None)
        if not had_flag:
            del fa_utils.is_flash_attn_greater_or_equal_2_10
        for name in [name for name in sys.modules if name.startswith("ring_flash_attn")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_transformers_still_reports_flash_attn_absent_while_the_shim_is_installed():
    from transformers.utils import import_utils

    modules = shim_modules()
    # Both checks are lru-cached: clear them so the answer is computed with the shim in place.
    checks = (import_utils.is_flash_attn_2_available, import_utils.is_flash_attn_greater_or_equal)
    before = flash_attn_available()
    sys.modules.update(modules)
    try:
        for check in checks:
            check.cache_clear()
        assert importlib.util.find_spec("flash_attn") is modules["flash_attn"].__spec__
        assert import_utils.is_flash_attn_2_available() is False
        assert import_utils.is_flash_attn_greater_or_equal("2.1.0") is False
        assert flash_attn_available() is before  # the shim never counts as flash-attn
    finally:
        for name in modules:
            sys.modules.pop(name, None)
        for check in checks:
            check.cache_clear()


def test_ring_flash_attn_imports_the_dispatching_kernels_and_keeps_them_after_the_shim_is_gone(
    ring_flash_attn,
):
    from ring_flash_attn import llama3_flash_attn_varlen, utils, zigzag_ring_flash_attn

    from cptune.parallel.kernels import dispatch

    # ring-flash-attn binds the kernels at import time, so the shim can go right after it.
    sys.modules.pop("flash_attn")
    sys.modules.pop("flash_attn.flash_attn_interface")
    assert llama3_flash_attn_varlen._flash_attn_varlen_forward is dispatch._flash_attn_varlen_forward
    assert llama3_flash_attn_varlen._flash_attn_varlen_backward is dispatch._flash_attn_varlen_backward
    assert zigzag_ring_flash_attn._flash_attn_forward is dispatch._flash_attn_forward
    assert zigzag_ring_flash_attn._flash_attn_backward is dispatch._flash_attn_backward
    # ring-flash-attn builds its keyword arguments from these defaults (utils.py get_default_args).
    defaults = utils.get_default_args(dispatch._flash_attn_varlen_backward)
    assert defaults["softcap"] == 0.0 and defaults["zero_tensors"] is False and "window_size_left" in defaults


def test_minus_inf_lse_for_rows_without_keys_keeps_ring_merge_correct(ring_flash_attn):
    """Why such rows get lse = -inf: with flash-attn's +inf, ring-flash-attn's merge wipes the output."""
    from ring_flash_attn.utils import update_out_and_lse

    q, k, v, _ = (t.float() for t in random_qkv(1, 4, 8, nheads=2, nheads_k=2))
    kwargs = {"dropout_p": 0.0, "softmax_scale": None, "window_size_left": -1, "window_size_right": -1}
    kwargs |= {"softcap": 0.0, "alibi_slopes": None, "return_softmax": False}
    first_out, first_lse, _, _ = _flash_attn_forward(q, k[:, :6], v[:, :6], causal=False, **kwargs)
    # Four queries against two keys, bottom-right causal: queries 0 and 1 see no key.
    second_out, second_lse, _, _ = _flash_attn_forward(q, k[:, 6:], v[:, 6:], causal=True, **kwargs)
    assert torch.all(second_lse[:, :, :2] == float("-inf"))

    out, lse = update_out_and_lse(None, None, first_out, first_lse)
    out, lse = update_out_and_lse(out, lse, second_out, second_lse)

    assert torch.equal(out[:, :2], first_out[:, :2])  # a -inf block weighs sigmoid(-inf) = 0: exactly nothing
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    out_plus_inf, _ = update_out_and_lse(
        *update_out_and_lse(None, None, first_out, first_lse),
        second_out,
        second_lse.nan_to_num(posinf=float("inf"), neginf=float("inf")),
    )
    assert torch.all(out_plus_inf[:, :2] == 0)  # flash-attn's convention would have lost the first block


def test_shim_patches_install_and_remove_the_modules():
    core = pytest.importorskip("cptune.patches.core")
    if flash_attn_available():
        pytest.skip("flash-attn is installed: the shim is not used")
    patch_set = core.PatchSet(flash_attn_shim_patches())
    assert patch_set.plan().ok
    with patch_set.applied():
        interface = importlib.import_module("flash_attn.flash_attn_interface")
        assert interface._flash_attn_varlen_backward.__signature__ == inspect.signature(
            _flash_attn_varlen_backward
        )
        assert sys.modules["flash_attn"].flash_attn_interface is interface
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("flash_attn.bert_padding")  # nothing else pretends to exist
    assert "flash_attn" not in sys.modules and "flash_attn.flash_attn_interface" not in sys.modules


def test_score_blocks_shrink_with_the_queries():
    """The attention workspace follows the local queries, so it shrinks with cp like the rest."""
    head = (4, 16)
    whole, quarter = torch.empty(1, 8192, *head), torch.empty(1, 2048, *head)
    assert blockwise.score_block_elements(quarter) * 4 == blockwise.score_block_elements(whole)
    assert blockwise.score_block_elements(torch.empty(1, 3, *head)) == blockwise._MIN_SCORE_ELEMENTS
    assert blockwise.score_block_elements(torch.empty(1, 1 << 20, *head)) == blockwise._MAX_SCORE_ELEMENTS
