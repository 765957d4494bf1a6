"""cp=2 and cp=4 of cptune's real multi-rank code on ONE GPU, against cp=1.

Usage (on a one-GPU machine; the lease script runs it)::

    python -m benchmarks.gpu.multirank --cp-sizes 2,4 --out OUT/multirank.json
    python -m benchmarks.gpu.multirank --device cpu --cp-sizes 2 --tiny   # CPU dry run of the plumbing

NCCL refuses two ranks on one device, so the ranks are processes sharing the GPU, joined by the
``staged_gloo`` group (:mod:`benchmarks.gpu.staged_gloo`: gloo on host copies). What runs on the
GPU is everything else: ring-flash-attn's code, cptune's kernels (PyTorch's FlashAttention-2),
cptune's sharding, attention routing and token-weighted loss. The cases are
:mod:`benchmarks.gpu.multirank_cases`'s. Passing (stated with the results): attention relative
errors (output and gradients against float64) at most 2e-2, bf16 inputs; model losses within
5e-3 relative of cp=1 and step-0 gradients within 5e-2 (max |diff| / max |ref| per LoRA tensor),
bf16 both sides.

Not covered (see notes/i17.md): the ``torch`` backend (DTensor's functional collectives would need
the staged group to serve them from C++), DeepSpeed Ulysses (DeepSpeed is not on the GPU image),
and the Trainer around it all (accelerate picks ``cuda:LOCAL_RANK``, which does not exist).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ATTENTION_LIMIT = 2e-2
LOSS_LIMIT = 5e-3
GRAD_LIMIT = 5e-2


def worker(rank: int, world: int, store: str, out: str, args: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.gpu import multirank_cases as cases
    from benchmarks.gpu import staged_gloo
    from cptune.parallel.backends.ring_flash_attn.sharding import load_ring_flash_attn

    device = args["device"]
    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
    else:
        torch.set_num_threads(1)
    dist.init_process_group(staged_gloo.register(), init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args["timeout"]))  # fmt: skip
    try:
        kernels = load_ring_flash_attn()
        import ring_flash_attn

        group = dist.group.WORLD
        results: dict[str, Any] = {}
        started = time.perf_counter()
        results["attention"] = cases.attention_cases(
            ring_flash_attn,
            group,
            device,
            args["attention_tokens"],
            (args["heads"], args["kv_heads"]),
            args["head_dim"],
            zigzag_ring=kernels.zigzag_ring,
        )
        models = {"tiny": cases.tiny_llama(args["tiny_vocab"])}
        if args["big_layers"]:
            models["llama-3.1-8b-shaped"] = cases.llama_31_8b_shaped(args["big_layers"], args["big_vocab"])
        for name, build in models.items():
            seq_len = args["tiny_seq_len"] if name == "tiny" else args["big_seq_len"]
            vocab = args["tiny_vocab"] if name == "tiny" else (args["big_vocab"] or 128256)
            for func in ("varlen_llama3", "batch_zigzag"):
                results[f"model {name} {func}"] = cases.model_case(
                    build, kernels, group, func=func, seq_len=seq_len, vocab=vocab, device=device
                )
        from cptune.parallel.kernels import dispatch

        probe = torch.zeros(1, 1, args["head_dim"], device=device, dtype=torch.bfloat16)
        kernel = dispatch.implementation("_flash_attn_varlen_forward", probe)
        results["kernels"] = f"{kernel.__module__}.{kernel.__name__} ({torch.__version__})"
        results["seconds"] = time.perf_counter() - started
        if device == "cuda":
            results["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if rank == 0:
            Path(out).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()


def run(cp_size: int, work: Path, args: dict[str, Any]) -> dict[str, Any]:
    """Launch ``cp_size`` processes (spawned: CUDA must not be forked) and return rank 0's results."""
    work = work.resolve()  # the file store's URL needs an absolute path
    work.mkdir(parents=True, exist_ok=True)
    store, out = work / f"store{cp_size}", work / f"cp{cp_size}.json"
    store.unlink(missing_ok=True)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=worker, args=(r, cp_size, str(store), str(out), args)) for r in range(cp_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + args["timeout"]
    # A rank that fails leaves the others waiting in a collective: stop them all at the first failure.
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in processes):
            break
        time.sleep(0.5)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    codes = [p.exitcode for p in processes]
    if any(codes) or not out.exists():
        late = " (stopped at the time limit)" if time.monotonic() >= deadline else ""
        return {"error": f"rank exit codes {codes}{late}"}
    return json.loads(out.read_text())


def verdicts(result: dict[str, Any]) -> dict[str, bool]:
    """Pass/fail of every case of one cp size (the limits in the module docstring)."""
    ok = {}
    for name, errors in result.get("attention", {}).items():
        ok[f"attention {name}"] = max(errors.values()) <= ATTENTION_LIMIT
    for name, value in result.items():
        if name.startswith("model "):
            ok[name] = value["loss_rel"] <= LOSS_LIMIT and value["grad_rel"] <= GRAD_LIMIT
    return ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.multirank", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--cp-sizes", type=ints, default=[2, 4])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--tiny", action="store_true", help="small sizes and no 8B-shaped model (CPU dry run)"
    )
    parser.add_argument(
        "--big-layers", type=int, default=2, help="layers of the Llama-3.1-8B-shaped model (0: skip)"
    )
    parser.add_argument("--big-seq-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu-multirank/multirank.json"))
    parser.add_argument(
        "--budget", type=float, default=150.0,
        help="seconds for every cp size together: each later cp size starts only if the time the last "
        "one took, x1.5, is left; a cp size still running at the end is stopped and recorded",
    )  # fmt: skip
    parser.add_argument(
        "--attention-tokens", type=int, default=2048,
        help="of the attention cases (each rank builds a float64 reference of the whole attention: "
        "about 5.5 GiB per rank at 2,048 tokens and 32 heads, x16 at 8,192)",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = {
        "device": args.device, "timeout": args.budget, "head_dim": 16 if args.tiny else 128,
        "attention_tokens": 64 if args.tiny else args.attention_tokens, "heads": 4 if args.tiny else 32, "kv_heads": 2 if args.tiny else 8,
        "tiny_vocab": 97, "tiny_seq_len": 64 if args.tiny else 1024,
        "big_layers": 0 if args.tiny else args.big_layers, "big_vocab": None, "big_seq_len": args.big_seq_len,
    }  # fmt: skip
    results: dict[str, Any] = {"settings": settings, "cp": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started, last = time.monotonic(), 0.0
    work = Path(tempfile.mkdtemp(prefix="cptune-multirank-"))  # rank files stay out of --out's folder
    for cp in args.cp_sizes:
        left = args.budget - (time.monotonic() - started)
        if results["cp"] and left < 1.5 * last:
            results["cp"][str(cp)] = {
                "skipped": f"{left:.0f} s left of --budget, the last cp size took {last:.0f} s"
            }
            print(f"[multirank] cp={cp} skipped: {results['cp'][str(cp)]['skipped']}", flush=True)
            continue
        print(f"[multirank] cp={cp} on one {args.device} device ...", flush=True)
        begun = time.monotonic()
        result = run(cp, work, settings | {"timeout": max(left, 10.0)})
        last = time.monotonic() - begun
        result["wall_seconds"] = last
        result["ok"] = verdicts(result)
        results["cp"][str(cp)] = result
        args.out.write_text(json.dumps(results, indent=1))  # after each cp size: a later failure keeps it
    args.out.write_text(json.dumps(results, indent=1))  # with the cp sizes skipped for the budget
    print(markdown(results))
    ran = {
        cp: r for cp, r in results["cp"].items() if "skipped" not in r
    }  # a skipped cp size has no verdicts
    failed = [f"cp={cp} {name}" for cp, r in ran.items() for name, ok in r["ok"].items() if not ok]
    failed += [f"cp={cp}: {r['error']}" for cp, r in ran.items() if "error" in r]
    total = sum(len(r["ok"]) or 1 for r in ran.values())
    print(f"multirank parity: {total - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


def markdown(results: dict[str, Any]) -> str:
    lines = ["| cp | case | result | ok |", "|---:|---|---|---|"]
    for cp, result in results["cp"].items():
        if "skipped" in result:
            lines.append(f"| {cp} | all | skipped: {result['skipped']} | |")
            continue
        if "error" in result:
            lines.append(f"| {cp} | all | {result['error']} | no |")
            continue
        for name, errors in result["attention"].items():
            text = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
            lines.append(
                f"| {cp} | attention {name} | rel. error {text} | {result['ok'][f'attention {name}']} |"
            )
        for name, value in result.items():
            if name.startswith("model "):
                text = (f"losses cp=1 {[round(x, 4) for x in value['ref_losses']]} vs {[round(x, 4) for x in value['cp_losses']]}; "
                        f"max loss rel {value['loss_rel']:.1e}, grad rel {value['grad_rel']:.1e}")  # fmt: skip
                lines.append(f"| {cp} | {name} | {text} | {result['ok'][name]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
