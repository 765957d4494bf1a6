"""The adapter onto PyTorch's FlashAttention-2 on a real GPU: forward, LSE and gradients.

Usage (on a CUDA machine; the lease script runs it first)::

    python -m benchmarks.gpu.check_kernels --out OUT/kernels.json [--time]
    python -m benchmarks.gpu.check_kernels --dry-run     # CPU: the float64 op stands in for torch's

Every case draws fresh random inputs, runs flash-attn 2.8's private kernels as cptune provides
them without flash-attn (:mod:`cptune.parallel.kernels.torch_flash`, i.e. the real
``aten._flash_attention_forward/backward``) in bf16 and fp16, and compares the output, the
log-sum-exp and dq/dk/dv with attention computed in float64 from the same rounded inputs
(:mod:`benchmarks.gpu.reference`), by ``||x - ref|| / ||ref||``. The pure-PyTorch stand-ins run
the same inputs: their error is the floor a half-precision kernel is measured against. Gradients
start as NaN, so an element the kernels never write fails. Cases: dense causal and bidirectional;
bottom-right causal with fewer queries than keys (ring-flash-attn's llama3 layout) and with more
(rows that see no key: LSE -inf, output and dq 0); packed documents (varlen) with grouped-query
heads, causal, bidirectional and a sliding window; a band window on both sides of the diagonal (the
zigzag ring's windowed blocks); one key block's backward given the merged
output and LSE of all blocks (the zigzag ring); the differentiable
:func:`cptune.parallel.kernels.varlen.varlen_attention` (DeepSpeed's document attention), without and with a sliding window,
and with gpt-oss's attention sinks and a window (the sink applied to the merged ``(out, lse)``, the backward
given the sink attention's ``(out, lse)``: :mod:`cptune.parallel.kernels.sinks`; its gradient ``dsinks`` too);
the sinks on cptune's zigzag ring (``batch_zigzag``) at one rank, full causal and with a sliding window.
``--time`` adds the varlen kernels' forward+backward time against PyTorch's fused SDPA (flash
backend) on one 16K-token causal sequence with Llama-3.1-8B's attention shape.

Pass: relative error at most ``TOLERANCE[dtype]`` (METHOD.md: bf16 operands land between 1e-3 and
1e-2) or at most 1.5x the stand-ins' error; LSE (fp32) within 1e-3; the same infinities as the
reference. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu import reference

TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3}
LSE_TOLERANCE = 1e-3
GRADS = ("dq", "dk", "dv")


def _mask(causal: bool, window: tuple[int, int] = (-1, -1)) -> dict[str, Any]:
    return {"dropout_p": 0.0, "softmax_scale": None, "causal": causal,
            "window_size_left": window[0], "window_size_right": window[1]}  # fmt: skip


def _dense(kernels, q, k, v, dout, mask, out_lse=None) -> dict[str, Any]:
    """out, lse, dq, dk, dv of the dense kernels; ``out_lse`` replaces the forward's in the backward."""
    import torch

    out, lse, _, _ = kernels._flash_attn_forward(
        q, k, v, softcap=0.0, alibi_slopes=None, return_softmax=False, **mask
    )
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels._flash_attn_backward(dout, q, k, v, *(out_lse or (out, lse)), *grads, softcap=0.0,
                                 alibi_slopes=None, deterministic=False, **mask)  # fmt: skip
    return dict(zip(("out", "lse", *GRADS), (out, lse, *grads), strict=True))


def _varlen(kernels, q, k, v, dout, cu_q, cu_k, mask) -> dict[str, Any]:
    import torch

    seq = (cu_q, cu_k, int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max()))
    out, lse, _, _ = kernels._flash_attn_varlen_forward(q, k, v, *seq, **mask)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernels._flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, *seq, softcap=0.0, alibi_slopes=None,
                                        deterministic=False, **mask)  # fmt: skip
    return dict(zip(("out", "lse", *GRADS), (out, lse, *grads), strict=True))


def _reference(forward, q, k, v, dout) -> dict[str, Any]:
    """float64 out, lse and autograd gradients of ``forward`` at the (already rounded) inputs."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = forward(*leaves)
    out.backward(dout.double())
    return dict(
        zip(("out", "lse", *GRADS), (out.detach(), lse.detach(), *(x.grad for x in leaves)), strict=True)
    )


def _compare(case: str, dtype: str, got: dict, stand_in: dict, expected: dict) -> dict[str, Any]:
    """Relative errors of every tensor ``expected`` holds, with the stand-ins' and pass/fail."""
    row: dict[str, Any] = {"case": case, "dtype": dtype, "ok": True}
    for label, ref in expected.items():
        error = reference.relative_error(got[label], ref)
        floor = reference.relative_error(stand_in[label], ref)
        limit = LSE_TOLERANCE if label == "lse" else max(TOLERANCE[dtype], 1.5 * floor)
        row[label], row[f"{label}_stand_in"] = error, floor
        row["ok"] &= error <= limit
    return row


def run_checks(
    *,
    device: str = "cuda",
    size: int = 8,
    head_dim: int = 128,
    dtypes: tuple[str, ...] = ("bfloat16", "float16"),
    seed: int = 0,
    on_row=None,
) -> list[dict[str, Any]]:
    """Every case in each of ``dtypes``; sequence lengths scale with ``size`` (8: about 2K tokens a case).

    ``on_row(rows)`` is called after each dtype's cases (the lease writes its JSON there).
    """
    import torch

    from cptune.parallel.kernels import torch_flash
    from cptune.parallel.kernels.varlen import varlen_attention

    reason = torch_flash.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"PyTorch's FlashAttention-2 cannot run here: {reason}")
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = []

    def randn(*shape, dtype):
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    def n(length):  # lengths below are for size 8
        return max(1, length * size // 8)

    for name in dtypes:
        dtype = getattr(torch, name)
        dense_cases = {
            "dense causal": (n(512), n(512), 16, 4, True),
            "dense bidirectional": (n(384), n(384), 8, 8, False),
            "dense causal, fewer queries than keys (llama3 layout)": (n(256), n(640), 16, 4, True),
            "dense causal, more queries than keys (rows without keys)": (n(640), n(256), 8, 2, True),
        }
        for case, (sq, sk, h, hk, causal) in dense_cases.items():
            q, dout = randn(2, sq, h, head_dim, dtype=dtype), randn(2, sq, h, head_dim, dtype=dtype)
            k, v = randn(2, sk, hk, head_dim, dtype=dtype), randn(2, sk, hk, head_dim, dtype=dtype)

            rows.append(_guarded(case, name, _dense_case, case, name, q, k, v, dout, causal))
        # The zigzag ring's windowed blocks (ring_flash_attn/zigzag_blocks.py): as many queries as keys, not
        # causal, keys from `left` before to `right` after the diagonal.
        case = "dense band window, left and right (the zigzag ring's windowed blocks)"
        q, dout = randn(2, n(384), 8, head_dim, dtype=dtype), randn(2, n(384), 8, head_dim, dtype=dtype)
        k, v = randn(2, n(384), 2, head_dim, dtype=dtype), randn(2, n(384), 2, head_dim, dtype=dtype)
        rows.append(_guarded(case, name, _dense_case, case, name, q, k, v, dout, False, (n(96), n(160))))
        # Packed documents: a document of 5 tokens, one longer than the rest, keys > queries in one.
        bounds_q = [0, *_cumsum([n(37), n(700), 5, n(290), n(512)])]
        bounds_k = [0, *_cumsum([n(37), n(900), 5, n(290), n(512)])]
        cu_q, cu_k = (torch.tensor(b, dtype=torch.int32, device=device) for b in (bounds_q, bounds_k))
        varlen_cases = {
            "varlen causal, GQA 32/8": (32, 8, True, (-1, -1)),
            "varlen bidirectional, GQA 16/4": (16, 4, False, (-1, -1)),
            "varlen causal, sliding window 128": (8, 8, True, (128, -1)),
        }
        for case, (h, hk, causal, window) in varlen_cases.items():
            q, dout = (
                randn(bounds_q[-1], h, head_dim, dtype=dtype),
                randn(bounds_q[-1], h, head_dim, dtype=dtype),
            )
            k, v = (
                randn(bounds_k[-1], hk, head_dim, dtype=dtype),
                randn(bounds_k[-1], hk, head_dim, dtype=dtype),
            )
            packed = (bounds_q, bounds_k, cu_q, cu_k)
            rows.append(_guarded(case, name, _varlen_case, case, name, q, k, v, dout, packed, causal, window))
        rows.append(_guarded("merged-LSE backward of one key block", name,
                             _merged_lse_case, randn, dtype, name, n, head_dim))  # fmt: skip
        for window in (None, 128):  # DeepSpeed's document attention, and its sliding-window layers
            case = _autograd_name(window)
            rows.append(_guarded(case, name, _autograd_case, varlen_attention, randn, dtype, name, bounds_q,
                                 device, head_dim, window))  # fmt: skip
        rows.append(_guarded(SINKS_CASE, name, _sinks_case, varlen_attention, randn, dtype, name, bounds_q, device,
                             head_dim))  # fmt: skip
        for window in (None, n(96)):  # gpt-oss on the zigzag ring: its full and its sliding layers
            case = _zigzag_sinks_name(window)
            rows.append(_guarded(case, name, _zigzag_sinks_case, randn, dtype, name, n, head_dim, window))
        rows.append(_guarded(HEAD_GROUPS_CASE, name, _head_groups_case, varlen_attention, randn, dtype, name,
                             bounds_q, device, head_dim))  # fmt: skip
        if on_row is not None:
            on_row(rows)
    return rows


def _guarded(case: str, dtype: str, check, *args) -> dict[str, Any]:
    """``check(*args)``, one case's row; a case that raises is a failed row with its error, and the next runs."""
    try:
        return check(*args)
    except Exception as err:
        text = str(err).strip().splitlines()
        return {
            "case": case,
            "dtype": dtype,
            "ok": False,
            "error": f"{type(err).__name__}: {text[0] if text else ''}",
        }


def _dense_case(case, dtype, q, k, v, dout, causal, window=(-1, -1)) -> dict[str, Any]:
    from cptune.parallel.kernels import flash_attn_cpu, torch_flash

    expected = _reference(
        lambda a, b, c: reference.attention(a, b, c, causal=causal, window=window), q, k, v, dout
    )
    got = _dense(torch_flash, q, k, v, dout, _mask(causal, window))
    row = _compare(case, dtype, got, _dense(flash_attn_cpu, q, k, v, dout, _mask(causal, window)), expected)
    sq, sk = q.shape[1], k.shape[1]
    if sq > sk:  # the first sq - sk queries see no key: output and dq 0, LSE -inf
        blind = slice(0, sq - sk)
        row["no_key_rows_zero"] = bool((got["out"][:, blind] == 0).all() and (got["dq"][:, blind] == 0).all())
        row["no_key_rows_lse_inf"] = bool((got["lse"][:, :, blind] == float("-inf")).all())
        row["ok"] &= row["no_key_rows_zero"] and row["no_key_rows_lse_inf"]
    return row


def _varlen_case(case, dtype, q, k, v, dout, packed, causal, window) -> dict[str, Any]:
    from cptune.parallel.kernels import flash_attn_cpu, torch_flash

    bounds_q, bounds_k, cu_q, cu_k = packed
    mask = {"causal": causal, "window": window}
    expected = _reference(
        lambda a, b, c: reference.varlen_attention(a, b, c, bounds_q, bounds_k, **mask), q, k, v, dout
    )
    got = _varlen(torch_flash, q, k, v, dout, cu_q, cu_k, _mask(causal, window))
    stand_in = _varlen(flash_attn_cpu, q, k, v, dout, cu_q, cu_k, _mask(causal, window))
    return _compare(case, dtype, got, stand_in, expected)


def _cumsum(lengths: list[int]) -> list[int]:
    total, out = 0, []
    for length in lengths:
        total += length
        out.append(total)
    return out


def _merged_lse_case(randn, dtype, name, n, head_dim) -> dict[str, Any]:
    """The zigzag ring's backward: one key block's dk, dv given the merged out and LSE of all blocks."""
    from cptune.parallel.kernels import flash_attn_cpu, torch_flash

    q, dout = randn(1, n(256), 16, head_dim, dtype=dtype), randn(1, n(256), 16, head_dim, dtype=dtype)
    k, v = randn(1, n(768), 4, head_dim, dtype=dtype), randn(1, n(768), 4, head_dim, dtype=dtype)
    block = slice(0, n(512))
    full = _reference(lambda a, b, c: reference.attention(a, b, c, causal=False), q, k, v, dout)
    results = []
    for kernels in (torch_flash, flash_attn_cpu):
        merged = _dense(kernels, q, k, v, dout, _mask(False))  # what the ring's forward merges to
        part = _dense(
            kernels, q, k[:, block], v[:, block], dout, _mask(False), (merged["out"], merged["lse"])
        )
        results.append({"dk": part["dk"], "dv": part["dv"]})
    expected = {"dk": full["dk"][:, block], "dv": full["dv"][:, block]}
    return _compare("merged-LSE backward of one key block", name, results[0], results[1], expected)


def _autograd_name(window: int | None) -> str:
    suffix = "" if window is None else f", sliding window {window}"
    return f"varlen_attention autograd (document attention{suffix})"


def _autograd_case(
    varlen_attention, randn, dtype, name, bounds, device, head_dim, window=None
) -> dict[str, Any]:
    """cptune.parallel.kernels.varlen.varlen_attention, as DeepSpeed's document attention calls it.

    ``window``: transformers' ``sliding_window`` (a query sees that many keys, its own included), which
    varlen_attention hands the kernel as ``window_size_left = window - 1``.
    """
    import torch

    from cptune.parallel.kernels import flash_attn_cpu

    total = bounds[-1]
    q, dout = randn(total, 16, head_dim, dtype=dtype), randn(total, 16, head_dim, dtype=dtype)
    k, v = randn(total, 4, head_dim, dtype=dtype), randn(total, 4, head_dim, dtype=dtype)
    left = (-1, -1) if window is None else (window - 1, -1)
    expected = _reference(lambda a, b, c: reference.varlen_attention(a, b, c, bounds, bounds, causal=True,
                                                                      window=left), q, k, v, dout)  # fmt: skip
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(
        *leaves, cu, max(b - a for a, b in itertools.pairwise(bounds)), scale=None, causal=True, window=window
    )
    out.backward(dout)
    got = {"out": out.detach(), **dict(zip(GRADS, (x.grad for x in leaves), strict=True))}
    stand_in = _varlen(flash_attn_cpu, q, k, v, dout, cu, cu, _mask(True, left))
    expected.pop("lse")
    return _compare(_autograd_name(window), name, got, stand_in, expected)


SINKS_CASE = "varlen_attention autograd with attention sinks (gpt-oss), sliding window 128"


@dataclasses.dataclass(frozen=True)
class _StandInVarlen:
    """The stand-in varlen kernels as a :class:`cptune.parallel.kernels.sinks.SplitAttention` (the floor)."""

    cu: Any
    longest: int
    left: int

    def forward(self, q, k, v):
        from cptune.parallel.kernels import flash_attn_cpu

        out, lse, _, _ = flash_attn_cpu._flash_attn_varlen_forward(
            q, k, v, self.cu, self.cu, self.longest, self.longest, **_mask(True, (self.left, -1))
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse):
        import torch

        from cptune.parallel.kernels import flash_attn_cpu

        grads = [torch.empty_like(t) for t in (q, k, v)]
        flash_attn_cpu._flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, self.cu, self.cu, self.longest,
                                                   self.longest, softcap=0.0, alibi_slopes=None, deterministic=False,
                                                   **_mask(True, (self.left, -1)))  # fmt: skip
        return tuple(grads)


def _sinks_case(varlen_attention, randn, dtype, name, bounds, device, head_dim, window=128) -> dict[str, Any]:
    """gpt-oss's attention sinks through varlen_attention (DeepSpeed's document attention; the ring's varlen_llama3
    path puts them on its kernels the same way): out and dq, dk, dv, dsinks against softmax over [scores, sink]
    in float64, the sink dropped from the output (transformers' ``modeling_gpt_oss.eager_attention_forward``)."""
    import torch

    from cptune.parallel.kernels.sinks import attention_with_sinks

    total, heads = bounds[-1], 16
    q, dout = randn(total, heads, head_dim, dtype=dtype), randn(total, heads, head_dim, dtype=dtype)
    k, v = randn(total, 4, head_dim, dtype=dtype), randn(total, 4, head_dim, dtype=dtype)
    sinks = 2 * randn(heads, dtype=torch.float32)
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    outs = []
    for a, b in itertools.pairwise(bounds):  # each document: softmax over [scores, sink], the sink dropped
        qd, kd, vd = (t[a:b] for t in leaves64[:3])
        kd, vd = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (kd, vd))
        scores = torch.einsum("qhd,khd->hqk", qd, kd) * head_dim**-0.5
        distance = torch.arange(b - a, device=device)[:, None] - torch.arange(b - a, device=device)[None, :]
        scores = scores.masked_fill(~((distance >= 0) & (distance < window)), float("-inf"))
        logits = torch.cat([scores, leaves64[3][:, None, None].expand(-1, b - a, 1)], dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", logits.softmax(-1)[..., :-1], vd))
    out64 = torch.cat(outs)
    out64.backward(dout.double())
    labels = ("out", *GRADS, "dsinks")
    expected = dict(zip(labels, (out64.detach(), *(x.grad for x in leaves64)), strict=True))
    results = []
    for run in ("kernels", "stand-ins"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        if run == "kernels":
            out = varlen_attention(
                *leaves[:3], cu, longest, scale=None, causal=True, window=window, sinks=leaves[3]
            )
        else:
            out = attention_with_sinks(_StandInVarlen(cu, longest, window - 1), *leaves)
        out.backward(dout)
        results.append(dict(zip(labels, (out.detach(), *(x.grad for x in leaves)), strict=True)))
    return _compare(SINKS_CASE, name, results[0], results[1], expected)


def _zigzag_sinks_name(window: int | None) -> str:
    suffix = "full causal" if window is None else f"sliding window {window}"
    return f"zigzag ring with attention sinks (gpt-oss; one rank's 2 chunks, {suffix})"


def _zigzag_sinks_case(randn, dtype, name, n, head_dim, window) -> dict[str, Any]:
    """gpt-oss's sinks on cptune's zigzag ring (``ring_attn_func: batch_zigzag``) as one rank runs it at cp=1: the
    ring's blocks through torch's flash kernels (causal, cut and band-windowed), merged by log-sum-exp in fp32, the
    sink applied once to the merged ``(out, lse)``, and the ring's backward given the sink attention's; out and dq,
    dk, dv, dsinks against softmax over [scores, sink] in float64. Across ranks the ring only adds the exchange of
    K/V (tests/parallel/test_parity.py holds it to cp=1 on CPU)."""
    import torch
    import torch.distributed as dist

    from benchmarks.gpu.reference import visible_keys
    from cptune.parallel.backends.ring_flash_attn.zigzag_window import ZigzagRing
    from cptune.parallel.kernels import flash_attn_cpu, torch_flash
    from cptune.parallel.kernels.sinks import attention_with_sinks

    tokens, heads = 2 * n(192), 16
    q, dout = randn(2, tokens, heads, head_dim, dtype=dtype), randn(2, tokens, heads, head_dim, dtype=dtype)
    k, v = randn(2, tokens, 4, head_dim, dtype=dtype), randn(2, tokens, 4, head_dim, dtype=dtype)
    sinks = 2 * randn(heads, dtype=torch.float32)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    kx, vx = (t.repeat_interleave(heads // k.shape[2], dim=2) for t in leaves64[1:3])
    scores = torch.einsum("bqhd,bkhd->bhqk", leaves64[0], kx) * head_dim**-0.5
    seen = visible_keys(tokens, tokens, -1 if window is None else window - 1, 0, q.device)
    scores = scores.masked_fill(~seen, float("-inf"))
    logits = torch.cat([scores, leaves64[3][None, :, None, None].expand(2, -1, tokens, 1)], dim=-1)
    out64 = torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1)[..., :-1], vx)
    out64.backward(dout.double())
    labels = ("out", *GRADS, "dsinks")
    expected = dict(zip(labels, (out64.detach(), *(x.grad for x in leaves64)), strict=True))
    opened = not dist.is_initialized()
    if opened:  # one rank: the ring exchanges nothing, but asks the group for its rank and size
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = []
        for kernels in (torch_flash, flash_attn_cpu):
            ring = ZigzagRing(
                head_dim**-0.5, window, None, (kernels._flash_attn_forward, kernels._flash_attn_backward)
            )
            leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            out = attention_with_sinks(ring, *leaves)
            out.backward(dout)
            results.append(dict(zip(labels, (out.detach(), *(x.grad for x in leaves)), strict=True)))
    finally:
        if opened:
            dist.destroy_process_group()
    return _compare(_zigzag_sinks_name(window), name, results[0], results[1], expected)


def _head_groups_case(varlen_attention, randn, dtype, name, bounds, device, head_dim) -> dict[str, Any]:
    """The document attention a KV head at a time against one call: the same bits (heads are independent),
    and the backward's peak with one KV head's buffers instead of all of them (the GQA dK/dV expansion and
    the fp32 dQ accumulator).

    FlashAttention-2's backward adds each key block's dQ into an fp32 accumulator with atomics, in whatever
    order the blocks finish, so its dQ may differ from one run to the next; with
    ``torch.use_deterministic_algorithms(True)`` torch asks the kernel for its deterministic order. The
    lease of 2026-11-27 compared the two ways under the default: out, dK and dV the same bits, dQ not. So on
    CUDA the verdict compares them under the deterministic setting (every output and gradient the same bits),
    and the row also records, under the default, whether one call repeated gives the same dQ and how far
    the two ways' dQ are apart (:func:`benchmarks.gpu.reference.relative_error`), beside the peaks."""
    import torch

    total = bounds[-1]
    q, dout = randn(total, 32, head_dim, dtype=dtype), randn(total, 32, head_dim, dtype=dtype)
    k, v = randn(total, 8, head_dim, dtype=dtype), randn(total, 8, head_dim, dtype=dtype)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    peaks: list[int] = []

    def run(per_call: int | None, record_peak: bool = False) -> dict[str, Any]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*leaves, cu, longest, scale=None, causal=True, kv_heads_per_call=per_call)
        if record_peak and device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        out.backward(dout)
        if record_peak and device == "cuda":
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - before)
        return {"out": out.detach(), **dict(zip(GRADS, (x.grad for x in leaves), strict=True))}

    default = [run(None, record_peak=True), run(1, record_peak=True), run(None)]
    row: dict[str, Any] = {"case": HEAD_GROUPS_CASE, "dtype": name, "tokens": total}
    if device == "cuda":
        was, warn_only = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        torch.use_deterministic_algorithms(True)
        try:
            compared = [run(None), run(1)]
        finally:
            torch.use_deterministic_algorithms(was, warn_only=warn_only)
        row["deterministic"] = True
    else:
        compared = default[:2]
    row["bit_identical"] = {key: bool(torch.equal(compared[0][key], compared[1][key])) for key in compared[0]}
    row["default_order"] = {
        "bit_identical": {key: bool(torch.equal(default[0][key], default[1][key])) for key in default[0]},
        "dq_repeat_bit_identical": bool(torch.equal(default[0]["dq"], default[2]["dq"])),
        "dq_difference": reference.relative_error(default[1]["dq"], default[0]["dq"]),
        "dq_repeat_difference": reference.relative_error(default[2]["dq"], default[0]["dq"]),
    }
    if peaks:
        row["backward_peak_bytes"] = {"one call": peaks[0], "one KV head per call": peaks[1]}
    # The CPU stand-ins run batched products over other batch counts: bit identity is a CUDA property.
    row["ok"] = all(row["bit_identical"].values()) if device == "cuda" else True
    return row


HEAD_GROUPS_CASE = "varlen_attention one KV head per call (attention_kv_heads_per_call: 1)"


def time_against_sdpa(tokens: int = 16384, repeats: int = 10, device: str = "cuda") -> dict[str, Any]:
    """Median forward+backward ms: the varlen adapter against fused SDPA (flash) on one causal sequence."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.gpu.stand_in_kernels import median_seconds
    from cptune.parallel.kernels import torch_flash

    q = torch.randn(tokens, 32, 128, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(tokens, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    qs, ks, vs = (t.transpose(0, 1)[None].detach().requires_grad_() for t in (q, k, v))
    grad = dout.transpose(0, 1)[None]

    def adapter():
        _varlen(torch_flash, q, k, v, dout, cu, cu, _mask(True))

    group = q.shape[1] // k.shape[1]

    def sdpa_gqa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).backward(grad)

    def sdpa_expanded():  # as transformers' SDPA attention does (repeat_kv), inside the timed step
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            kx, vx = (t.repeat_interleave(group, dim=1) for t in (ks, vs))
            F.scaled_dot_product_attention(qs, kx, vx, is_causal=True).backward(grad)

    try:  # the flash backend may refuse grouped-query heads (enable_gqa) in this torch
        sdpa_gqa()
        sdpa, sdpa_form = sdpa_gqa, "enable_gqa"
    except RuntimeError:
        sdpa, sdpa_form = sdpa_expanded, "keys and values expanded to 32 heads"

    def median_ms(step):
        return median_seconds(step, repeats) * 1e3

    # Alternate the two, twice, so a drift of the card's clock hits both alike.
    adapter_runs, sdpa_runs = [], []
    for _ in range(2):
        adapter_runs.append(median_ms(adapter))
        sdpa_runs.append(median_ms(sdpa))
    adapter_ms, sdpa_ms = min(adapter_runs), min(sdpa_runs)
    return {"tokens": tokens, "adapter_ms": adapter_ms, "sdpa_flash_ms": sdpa_ms, "ratio": adapter_ms / sdpa_ms,
            "adapter_runs_ms": adapter_runs, "sdpa_runs_ms": sdpa_runs, "sdpa_heads": sdpa_form}  # fmt: skip


def environment() -> dict[str, Any]:
    import torch

    from cptune.parallel.kernels import torch_flash

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)",
        "kernels": torch_flash.KERNELS,
        "unavailable_reason": torch_flash.unavailable_reason(),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | dtype | out | lse | dq | dk | dv | stand-ins' worst | ok |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['dtype']} | {r['error']} | | | | | | NO |")
            continue
        floor = max(r.get(f"{x}_stand_in", 0.0) for x in ("out", *GRADS))
        errors = " | ".join(f"{r[x]:.1e}" if x in r else "" for x in ("out", "lse", *GRADS))
        if "bit_identical" in r:  # compared with one call, bit for bit
            same = r["bit_identical"]
            errors = " | ".join(
                "" if x not in same else "same bits" if same[x] else "DIFFERS" for x in ("out", "lse", *GRADS)
            )
        case = r["case"] + (f" (dsinks {r['dsinks']:.1e})" if "dsinks" in r else "")
        if r.get("deterministic"):
            order = r["default_order"]
            case += (
                "; torch's deterministic setting; in its default order dq repeats "
                + (
                    "bit for bit"
                    if order["dq_repeat_bit_identical"]
                    else f"to {order['dq_repeat_difference']:.1e}"
                )
                + f", one call vs per head {order['dq_difference']:.1e}"
            )
        lines.append(f"| {case} | {r['dtype']} | {errors} | {floor:.1e} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.check_kernels", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--time", action="store_true", help="also time the kernels against fused SDPA")
    parser.add_argument(
        "--size", type=int, default=8, help="sequence lengths scale with this (8: ~2K tokens)"
    )
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU, tiny sizes, the float64 op with the contract of torch's in its place")  # fmt: skip
    args = parser.parse_args(argv)
    # cuBLAS refuses its kernels under torch.use_deterministic_algorithms (the head-groups case) unless
    # this is set before its first use.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    results: dict[str, Any] = {"environment": environment()}

    def save() -> None:  # after each dtype and after the timing: a crash or a timeout keeps the rest
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))

    context = contextlib.nullcontext()
    if args.dry_run:
        from benchmarks.gpu.reference_ops import substituted

        context = substituted()
    with context:
        results["checks"] = run_checks(
            device="cpu" if args.dry_run else "cuda",
            size=1 if args.dry_run else args.size,
            on_row=lambda rows: (results.__setitem__("checks", rows), save()),
        )
        save()
        print(markdown(results["checks"]), flush=True)
        if args.time:
            try:  # the dry run times 128 tokens on the CPU (the float64 op in torch's place): plumbing only
                results["timing"] = time_against_sdpa(128, 2, "cpu") if args.dry_run else time_against_sdpa()
            except Exception as err:
                results["timing"] = {"error": f"{type(err).__name__}: {str(err).strip()[:300]}"}
            save()
            t = results["timing"]
            if "error" in t:
                print(f"timing failed: {t['error']}")
            else:
                print(f"timing, {t['tokens']} tokens fwd+bwd: adapter {t['adapter_ms']:.2f} ms, SDPA flash "
                      f"{t['sdpa_flash_ms']:.2f} ms, ratio {t['ratio']:.3f} (SDPA heads: {t['sdpa_heads']})")  # fmt: skip
    failed = [f"{r['case']} ({r['dtype']})" for r in results["checks"] if not r["ok"]]
    print(f"kernel checks: {len(results['checks']) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
