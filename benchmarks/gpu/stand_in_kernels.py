"""cptune's pure-PyTorch stand-ins for flash-attn's kernels against PyTorch's fused SDPA, on one GPU.

Usage (on a GPU machine)::

    python -m benchmarks.gpu.stand_in_kernels --tokens 4096,16384

Without flash-attn, the ring-flash-attn backend computes every attention block with
the stand-ins (:mod:`cptune.parallel.kernels.flash_attn_cpu`). This measures what
that costs on a GPU: one causal sequence with Llama-3.1-8B's attention shape (32 query
and 8 KV heads of 128), bf16, forward and backward, each side the median of 5 timed
repeats after one warm-up, CUDA-synchronised; and the peak memory each allocates.
Both sides run in this process, one after the other, so the ratio holds on a busy GPU.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from benchmarks.gpu.flops import LLAMA_31_8B


def median_seconds(step: Callable[[], object], repeats: int = 5) -> float:
    """Median CUDA-synchronised seconds of ``step`` over ``repeats`` runs after one warm-up."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    step()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def _peak_bytes(step: Callable[[], object]) -> int:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def compare(tokens: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from cptune.parallel.kernels import flash_attn_cpu as stand_in

    shape = LLAMA_31_8B
    torch.manual_seed(0)
    q = torch.randn(tokens, shape.heads, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, shape.kv_heads, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    cu_seqlens = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    scale = shape.head_dim**-0.5

    def stand_in_step() -> torch.Tensor:
        out, lse, *_ = stand_in._flash_attn_varlen_forward(
            q, k, v, cu_seqlens, cu_seqlens, tokens, tokens, 0.0, scale, True
        )
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        stand_in._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens, cu_seqlens, tokens, tokens,
            0.0, scale, True, -1, -1, 0.0, None, False,
        )  # fmt: skip
        return out

    # SDPA takes (batch, heads, tokens, head_dim).
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0).detach().requires_grad_() for t in (q, k, v))
    grad = dout.transpose(0, 1).unsqueeze(0)

    def sdpa_step() -> torch.Tensor:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out.backward(grad)
        return out

    stand_in_seconds, sdpa_seconds = median_seconds(stand_in_step), median_seconds(sdpa_step)
    difference = (stand_in_step().float() - sdpa_step()[0].transpose(0, 1).float()).abs().max().item()
    return {
        "tokens": tokens,
        "stand_in_ms": stand_in_seconds * 1e3,
        "sdpa_ms": sdpa_seconds * 1e3,
        "ratio": stand_in_seconds / sdpa_seconds,
        "stand_in_peak_gib": _peak_bytes(stand_in_step) / 2**30,
        "sdpa_peak_gib": _peak_bytes(sdpa_step) / 2**30,
        "max_abs_difference": difference,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.stand_in_kernels", description=__doc__)
    parser.add_argument("--tokens", default="4096,16384", help="sequence lengths, comma-separated")
    args = parser.parse_args(argv)
    print("| tokens | stand-ins ms | SDPA ms | ratio | stand-ins peak GiB | SDPA peak GiB | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in (int(t) for t in args.tokens.split(",") if t):
        r = compare(tokens)
        print(
            f"| {r['tokens']} | {r['stand_in_ms']:.1f} | {r['sdpa_ms']:.1f} | {r['ratio']:.0f}x | "
            f"{r['stand_in_peak_gib']:.2f} | {r['sdpa_peak_gib']:.2f} | {r['max_abs_difference']:.3g} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
