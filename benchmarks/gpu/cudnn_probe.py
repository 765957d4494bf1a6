"""Can cuDNN's attention (what SDPA picks on Hopper) serve ring-flash-attn's blocks? A one-call probe.

Usage (one GPU): ``python -m benchmarks.gpu.cudnn_probe --out OUT/cudnn.json``

Issue 27's lease found transformers' SDPA on an H200 running cuDNN's sm90 flash kernels, 1.8x
faster than PyTorch's FlashAttention-2 kernels that cptune's adapter calls. Each probe in its own
try, results written as they come: (1) dense causal GQA-expanded 16K forward, output and LSE
against FlashAttention-2's, LSE layout; (2) backward given an LSE (a ring's merged one): dq/dk/dv
against FlashAttention-2's; (3) varlen (cum_seq_q/k) forward on packed documents against
per-document dense; (4) fwd+bwd time of both at 16K tokens, 32 heads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    out: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}

    def save():
        args.out.write_text(json.dumps(out, indent=1, default=str))

    def probe(name, fn):
        try:
            out[name] = fn()
        except Exception as err:
            out[name] = {"error": f"{type(err).__name__}: {str(err).strip()[:400]}"}
        print(name, json.dumps(out[name], default=str)[:600], flush=True)
        save()

    aten = torch.ops.aten
    g = torch.Generator(device="cuda").manual_seed(0)
    s, h, d = args.tokens, 32, 128

    def randn(*shape):
        return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)

    q, k, v, do = (randn(1, h, s, d) for _ in range(4))  # (b, h, s, d) as SDPA takes them

    def flash():
        r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
        return r[0], r[1]  # out, lse (b, h, s)

    def cudnn():
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
        return r

    def dense():
        fo, fl = flash()
        r = cudnn()
        co, cl = r[0], r[1]
        return {
            "out_rel_to_flash": rel(co, fo),
            "lse_shape": list(cl.shape),
            "lse_stride": list(cl.stride()),
            "lse_dtype": str(cl.dtype),
            "flash_lse_shape": list(fl.shape),
            "lse_rel_to_flash": rel(cl.reshape(fl.shape), fl),
            "out_stride": list(co.stride()),
        }

    probe("dense_forward", dense)

    def given_lse():
        fo, fl = flash()
        r = cudnn()
        cl = r[1]
        fq = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
        fgrads = aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, fo, fl, fq[2], fq[3], fq[4], fq[5], 0.0, True, fq[6], fq[7]
        )
        # cuDNN backward fed FlashAttention-2's out and LSE (as a ring feeds the merged ones). The raw
        # op takes no empty bias from Python (it asks for 2-4 dims), so a zero (1, 1, 1, 1) bias.
        cgrads = aten._scaled_dot_product_cudnn_attention_backward(
            do,
            q,
            k,
            v,
            fo,
            fl.reshape(cl.shape).contiguous() if fl.numel() == cl.numel() else fl,
            r[6],
            r[7],
            torch.zeros(1, 1, 1, 1, device="cuda", dtype=torch.bfloat16),
            r[2],
            r[3],
            r[4],
            r[5],
            0.0,
            True,
        )
        return {f"d{n}_rel_to_flash": rel(c, f) for n, c, f in zip("qkv", cgrads, fgrads[:3], strict=True)}

    probe("backward_given_lse", given_lse)

    def varlen():
        lengths = [s // 8, s // 2, s - s // 8 - s // 2]
        cu = torch.tensor([0, lengths[0], lengths[0] + lengths[1], s], dtype=torch.int32, device="cuda")
        results = {}
        for layout in ("thd", "bhsd"):
            try:
                if layout == "thd":
                    qq, kk, vv = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # (total, h, d)
                else:
                    qq, kk, vv = q, k, v
                r = aten._cudnn_attention_forward(
                    qq, kk, vv, None, cu, cu, max(lengths), max(lengths), True, 0.0, True, False
                )
                o = r[0]
                ref = []
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
                    ref.append(
                        aten._scaled_dot_product_flash_attention(
                            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], 0.0, True, False
                        )[0]
                    )
                ref = torch.cat(ref, dim=2)
                got = o if layout == "bhsd" else o.transpose(0, 1)[None]
                results[layout] = {
                    "out_shape": list(o.shape),
                    "lse_shape": list(r[1].shape),
                    "out_rel_to_per_document_flash": rel(got.reshape(ref.shape), ref),
                }
            except Exception as err:
                results[layout] = {"error": f"{type(err).__name__}: {str(err).strip()[:300]}"}
        return results

    probe("varlen_forward", varlen)

    def timing():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from benchmarks.gpu.stand_in_kernels import median_seconds

        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def fa2():
            r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
            aten._scaled_dot_product_flash_attention_backward(
                do, q, k, v, r[0], r[1], r[2], r[3], r[4], r[5], 0.0, True, r[6], r[7]
            )

        def cudnn_sdpa():  # through SDPA's autograd, as transformers' SDPA path runs it
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(do)

        fa2_runs, cudnn_runs = [], []
        for _ in range(2):  # alternated, so a clock drift hits both
            fa2_runs.append(median_seconds(fa2, 10) * 1e3)
            cudnn_runs.append(median_seconds(cudnn_sdpa, 10) * 1e3)
        return {"tokens": s, "heads": h, "fa2_ms": min(fa2_runs), "cudnn_ms": min(cudnn_runs),
                "ratio_cudnn_to_fa2": min(cudnn_runs) / min(fa2_runs), "runs": [fa2_runs, cudnn_runs]}  # fmt: skip

    probe("timing_fwd_bwd", timing)


if __name__ == "__main__":
    main()
