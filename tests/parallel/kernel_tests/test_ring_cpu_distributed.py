"""ring-flash-attn's real CP code on gloo, with cptune's CPU kernels standing in for flash-attn.

Process start-up dominates here (torch, transformers and ring_flash_attn take seconds to import
and the kernels milliseconds to run), so one launcher process imports everything once, then
forks the gloo workers of world 2 and of world 4 from that state; each worker runs all of its
cases. World 4 runs CP over all four ranks and, on two subgroups of two ranks, CP=2 next to data
parallelism. Each worker creates its own process group (its only owner) from a file store, so
no port can be taken. The launcher is this file: ``python test_ring_cpu_distributed.py OUT_DIR``.

Errors are per tensor, max |error| / max |float64 reference|. fp32: the twins rule (tests/numerics.py),
the same attention computed the plain way in fp32 in one process, in the tokens' own order and in 2
others (tests/token_orders.py), setting the scale. bf16: a reorder floor measured in the same run.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tests import reorder
from tests.numerics import draws_per_tensor, float64_twins_excess
from tests.token_orders import TWIN_ORDERS, assert_distinct_draws, assert_legal_twin

pytestmark = pytest.mark.distributed

WORLD_SIZES = (2, 4)
SEQ_LENS = (20, 41, 35)  # three packed documents, 96 tokens: divisible by 2, 4 and 2 * 4
NHEADS, NHEADS_K, HEAD_DIM = 4, 2, 16
# bf16 rounds q, k, v, out and the gradients (eps 7.8e-3). Reorder floor: cp=1 with torch's SDPA in
# bf16 against the same reference, in the same run; a ring may land at most 1.5x as far (it rounds
# the same inputs and outputs once, and merges its blocks' parts in fp32).
BF16_BASELINE_FACTOR = 1.5
TIMEOUT_S = 120
ROOT = Path(__file__).resolve().parents[3]
SRC = ROOT / "src"


# ---- the tests (pytest process) -------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, float]]:
    """Run the launcher once; return ``{case: {"out"|"dq"|"dk"|"dv": relative error}}`` (module docstring)."""
    out_dir = tmp_path_factory.mktemp("ring_cpu")
    pythonpath = os.pathsep.join(filter(None, [str(SRC), str(ROOT), os.environ.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(out_dir)],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert completed.returncode == 0, (
        f"launcher failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"
    )
    table = {}
    for world_size in WORLD_SIZES:
        table |= json.loads((out_dir / f"world{world_size}.json").read_text())
    return table


def cases(results: dict[str, dict[str, float]], prefix: str) -> dict[str, dict[str, float]]:
    selected = {name: errors for name, errors in results.items() if name.startswith(prefix)}
    # Three CP layouts (world2 cp2, world4 cp4, world4 cp2xdp2); llama3 has 4 cases per layout,
    # 2 on torch's kernels.
    expected = {"llama3": 12, "torch-flash llama3": 6}
    assert len(selected) == expected.get(prefix, 3), sorted(results)
    return selected


def assert_within_fp32_rule(
    results: dict[str, dict[str, float]], name: str, errors: dict[str, float]
) -> None:
    """An fp32 case's errors within the twins rule: plain fp32 attention in one process and its 2 twins set the scale."""
    mask = "dense" if "zigzag" in name else "causal=False" if "causal=False" in name else "causal=True"
    floors = [results[f"fp32-one-process {mask} order={order}"] for order in (None, *TWIN_ORDERS)]
    draws = results[f"fp32-one-process {mask} draws"]  # distinct fp32 references per tensor
    excess = {
        key: float64_twins_excess(error, [f[key] for f in floors], draws=int(draws[key]))
        for key, error in errors.items()
    }
    assert max(excess.values()) <= 1, f"{name}: {errors}, one process {floors}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_the_twin_orders_compute_the_reference_function_in_another_order(causal):
    """The one-process references' twins (``_reference``'s ``order``) are legal: the same function, a noise of their own
    in every tensor (``assert_distinct_draws``)."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    shapes = [(sum(SEQ_LENS), heads, HEAD_DIM) for heads in (NHEADS, NHEADS_K, NHEADS_K, NHEADS)]
    qkvd = [torch.randn(shape, generator=generator) for shape in shapes]
    cu_seqlens = [0, *itertools.accumulate(SEQ_LENS)]
    ref64, ref32 = (_reference(*qkvd, cu_seqlens, causal, dtype) for dtype in (torch.float64, torch.float32))
    twins32 = []
    for order in TWIN_ORDERS:
        twin64 = _reference(*qkvd, cu_seqlens, causal, torch.float64, order)
        twins32.append(_reference(*qkvd, cu_seqlens, causal, torch.float32, order))
        assert_legal_twin(twin64, ref64, twins32[-1], ref32, what=order)
    assert_distinct_draws([ref32, *twins32])


def test_llama3_varlen_fp32_matches_single_process(results):
    """Packed documents, causal and bidirectional, heads_k_stride 1 and 2: exact in fp32."""
    for name, errors in cases(results, "llama3").items():
        assert_within_fp32_rule(results, name, errors)


def assert_within_bf16_floor(
    results: dict[str, dict[str, float]], name: str, errors: dict[str, float]
) -> None:
    """A bf16 case's errors within BF16_BASELINE_FACTOR of cp=1 SDPA in bf16, measured in the same launch."""
    (world,) = [part for part in name.split() if part.startswith("world")]
    floor = results[f"baseline-bf16 {world}"]
    grads = ("dq", "dk", "dv")
    assert errors["out"] <= BF16_BASELINE_FACTOR * floor["out"], f"{name}: {errors}, cp=1 {floor}"
    assert max(errors[g] for g in grads) <= BF16_BASELINE_FACTOR * max(floor[g] for g in grads), (
        f"{name}: {errors}, cp=1 {floor}"
    )


def test_zigzag_ring_bf16_within_the_bf16_floor(results):
    for name, errors in cases(results, "zigzag-bf16").items():
        assert_within_bf16_floor(results, name, errors)


def test_ring_flash_attn_on_torch_flash_kernels_matches_single_process(results):
    """ring-flash-attn's real code through the adapter onto torch's FlashAttention-2 ops.

    The CUDA ops are replaced by a float64 op with their contract (benchmarks/gpu/reference_ops.py): this
    checks the adapter inside the real ring code, llama3 (fp32, exact) and the zigzag ring,
    whose backward takes the merged output and LSE (bf16, as ring-flash-attn 0.1.8 needs).
    """
    for name, errors in cases(results, "torch-flash llama3").items():
        assert_within_fp32_rule(results, name, errors)
    for name, errors in cases(results, "torch-flash zigzag-bf16").items():
        assert_within_bf16_floor(results, name, errors)


def test_ring_code_over_the_staged_gloo_group_of_the_one_gpu_harness(results):
    """benchmarks/gpu/staged_gloo.py (several ranks on one GPU) carries the ring code and the collectives.

    Here its host copies are copies of CPU tensors: the same staging and copying back as on a GPU.
    """
    staged = {name: errors for name, errors in results.items() if name.startswith("staged-gloo")}
    assert len(staged) == 3 * 3, sorted(results)  # llama3, zigzag and the collectives on each layout
    for name, errors in staged.items():
        if "zigzag" in name:
            assert_within_bf16_floor(results, name, errors)
        elif "collectives" not in name:
            assert_within_fp32_rule(results, name, errors)
    for name in (n for n in staged if "collectives" in n):
        assert staged[name] == dict.fromkeys(
            ("all_gather", "reduce_scatter", "all_to_all", "all_reduce"), 0.0
        )


def _collectives_case(plain, staged):
    """The staged group's results against plain gloo's, bit for bit."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(plain), dist.get_world_size(plain)
    x = torch.arange(6 * world, dtype=torch.float32) * (rank + 1)
    results = {}
    for name, run in {
        "all_gather": lambda g: _gather(x, g, world),
        "reduce_scatter": lambda g: _reduce_scatter(x, g),
        "all_to_all": lambda g: _all_to_all(x, g),
        "all_reduce": lambda g: _all_reduce(x, g),
    }.items():
        results[name] = (run(plain) - run(staged)).abs().max().item()
    return results


def _reduce_scatter(x, group):
    import torch
    import torch.distributed as dist

    out = torch.empty(x.shape[0] // dist.get_world_size(group))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _all_to_all(x, group):
    import torch
    import torch.distributed as dist

    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _all_reduce(x, group):
    import torch.distributed as dist

    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def test_zigzag_ring_fp32_gradients_are_still_wrong_upstream(results):
    """ring-flash-attn 0.1.8 zigzag_ring_flash_attn.py:164-166 does ``dq = dq_buffer.to(torch.float32)``.

    In fp32 that is the buffer itself, which the next block's backward overwrites, so the
    gradients come out wrong while the forward is fine. If this fails, upstream fixed it and
    cptune can allow fp32 with the zigzag ring.
    """
    for name, errors in cases(results, "zigzag-fp32").items():
        assert_within_fp32_rule(results, name, {"out": errors["out"]})
        assert max(errors[g] for g in ("dq", "dk", "dv")) > 1e-2, f"{name}: {errors}"


# ---- the worker (child process) -------------------------------------------------------------


def _import_ring_flash_attn():
    """Import ring_flash_attn with the shim and the transformers flag, then remove both again."""
    import transformers.modeling_flash_attention_utils as fa_utils

    from cptune.parallel.kernels import flash_attn_available, shim_modules

    modules = {} if flash_attn_available() else shim_modules()
    had_flag = hasattr(fa_utils, "is_flash_attn_greater_or_equal_2_10")
    fa_utils.is_flash_attn_greater_or_equal_2_10 = getattr(
        fa_utils, "is_flash_attn_greater_or_equal_2_10", True
    )
    sys.modules.update(modules)
    try:
        import ring_flash_attn
    finally:
        for name in modules:
            del sys.modules[name]
        if not had_flag:
            del fa_utils.is_flash_attn_greater_or_equal_2_10
    return ring_flash_attn


def _reference(q, k, v, dout, cu_seqlens, causal, dtype=None, order=None):
    """Single-process attention per document in ``dtype`` (default float64), with autograd gradients: the kernels'
    dense reference (dense_reference.py's ``varlen_reference``, q and k cut at the same boundaries); ``order``: a
    twin's (tests/token_orders.py)."""
    import torch

    from tests.parallel.kernel_tests.dense_reference import varlen_reference

    dtype = dtype or torch.float64
    inputs = (t.to(dtype) for t in (q, k, v, dout))
    out, _, grads = varlen_reference(*inputs, cu_seqlens, cu_seqlens, order, causal=causal)
    return {"out": out, **dict(zip(("dq", "dk", "dv"), grads, strict=True))}


def _gather(tensor, group, world):
    import torch
    import torch.distributed as dist

    full = torch.empty((world * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
    dist.all_gather_into_tensor(full, tensor.contiguous(), group=group)
    return full


def _errors(got, expected):
    """Per tensor: max |got - expected| / max |expected|."""
    return {
        name: ((got[name].double() - ref).abs().max() / ref.abs().max()).item()
        for name, ref in expected.items()
    }


def _llama3_case(ring, data, group, causal, stride):
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cu_seqlens = torch.tensor(data["cu_seqlens"], dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, local_k_slice = ring.llama3_flash_attn_prepare_cu_seqlens(
        cu_seqlens, causal, rank, world
    )
    shard = slice(rank * data["q"].shape[0] // world, (rank + 1) * data["q"].shape[0] // world)
    q, k, v = (data[name][shard].clone().requires_grad_() for name in ("q", "k", "v"))
    out = ring.llama3_flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, stride, local_k_slice, causal=causal, group=group
    )
    out.backward(data["dout"][shard])
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return _errors({name: _gather(t, group, world) for name, t in got.items()}, data[f"ref_causal={causal}"])


def _zigzag_case(ring, data, group, dtype):
    """Dense causal attention over the whole packed row, zigzag layout (chunks r and 2W-1-r)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    order = [c for r in range(world) for c in (r, 2 * world - 1 - r)]
    inverse = [order.index(c) for c in range(2 * world)]

    def local(t):
        return torch.cat([t.chunk(2 * world)[order[2 * rank + i]] for i in range(2)])[None]

    q, k, v = (local(data[name]).to(dtype).requires_grad_() for name in ("q", "k", "v"))
    out = ring.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group)
    out.backward(local(data["dout"]).to(dtype))
    got = {}
    for name, tensor in {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}.items():
        chunks = _gather(tensor[0], group, world).chunk(2 * world)
        got[name] = torch.cat([chunks[inverse[c]] for c in range(2 * world)])
    ref = data["ref_dense_bf16"] if dtype == torch.bfloat16 else data["ref_dense"]
    return _errors(got, ref)


def _sdpa_bf16_errors(data):
    """cp=1 in bf16 with another kernel (torch's SDPA over the whole row): its error is bf16's floor."""
    import torch.nn.functional as F

    q, k, v = (data[name].bfloat16().transpose(0, 1)[None].requires_grad_() for name in ("q", "k", "v"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(data["dout"].bfloat16().transpose(0, 1)[None])
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return _errors({name: t[0].transpose(0, 1) for name, t in got.items()}, data["ref_dense_bf16"])


def _worker(rank: int, world_size: int, store: str, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    from cptune.run.training.distributed import close_process_groups

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        # Imported by the launcher before it forked (import here only under a spawn start method).
        ring = sys.modules.get("ring_flash_attn") or _import_ring_flash_attn()
        results = {}
        generator = torch.Generator().manual_seed(1234)
        total = sum(SEQ_LENS)
        data = {
            "q": torch.randn(total, NHEADS, HEAD_DIM, generator=generator),
            "k": torch.randn(total, NHEADS_K, HEAD_DIM, generator=generator),
            "v": torch.randn(total, NHEADS_K, HEAD_DIM, generator=generator),
            "dout": torch.randn(total, NHEADS, HEAD_DIM, generator=generator),
            "cu_seqlens": [0, *itertools.accumulate(SEQ_LENS)],
        }
        qkvd = [data[name] for name in ("q", "k", "v", "dout")]
        for mask, cu_seqlens, causal in (
            ("causal=True", data["cu_seqlens"], True),
            ("causal=False", data["cu_seqlens"], False),
            ("dense", [0, total], True),
        ):
            data[f"ref_{mask}"] = _reference(*qkvd, cu_seqlens, causal)
            references = [
                _reference(*qkvd, cu_seqlens, causal, torch.float32, o) for o in (None, *TWIN_ORDERS)
            ]
            for order, one_process in zip((None, *TWIN_ORDERS), references, strict=True):
                results[f"fp32-one-process {mask} order={order}"] = _errors(one_process, data[f"ref_{mask}"])
            results[f"fp32-one-process {mask} draws"] = draws_per_tensor(references)  # the twins rule's count
        # The bf16 reference sees the same rounded inputs, so only the kernels' rounding is measured.
        data["ref_dense_bf16"] = _reference(*(t.bfloat16() for t in qkvd), [0, total], causal=True)

        results[f"baseline-bf16 world{world_size}"] = _sdpa_bf16_errors(data)
        groups = {f"world{world_size} cp{world_size}": dist.group.WORLD}
        if world_size == 4:
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
            groups["world4 cp2xdp2"] = pairs[rank // 2]
        for label, group in groups.items():
            for causal, stride in itertools.product((True, False), (1, 2)):
                name = f"llama3 {label} causal={causal} heads_k_stride={stride}"
                results[name] = _llama3_case(ring, data, group, causal, stride)
            results[f"zigzag-bf16 {label}"] = _zigzag_case(ring, data, group, torch.bfloat16)
            results[f"zigzag-fp32 {label}"] = _zigzag_case(ring, data, group, torch.float32)
        # The same ring code on the adapter onto torch's flash ops (the float64 op stands in for
        # the CUDA-only ones; the dispatcher is told the tensors are ones torch's kernels take).
        from benchmarks.gpu.reference_ops import REFERENCE_OPS

        from cptune.parallel.kernels import torch_flash

        torch_flash.flash_ops, torch_flash.runs = (lambda: REFERENCE_OPS), (lambda q: True)
        # ... and over the one-GPU harness's process group (every rank creates every group).
        from benchmarks.gpu import staged_gloo

        staged_gloo.register()
        staged_groups = {"world": dist.new_group(backend=staged_gloo.BACKEND)}
        if world_size == 4:
            staged_pairs = [
                dist.new_group([0, 1], backend=staged_gloo.BACKEND),
                dist.new_group([2, 3], backend=staged_gloo.BACKEND),
            ]
            staged_groups["pairs"] = staged_pairs[rank // 2]
        for label, group in groups.items():
            staged = staged_groups["pairs" if "cp2xdp2" in label else "world"]
            results[f"staged-gloo llama3 {label}"] = _llama3_case(ring, data, staged, True, 2)
            results[f"staged-gloo zigzag-bf16 {label}"] = _zigzag_case(ring, data, staged, torch.bfloat16)
            results[f"staged-gloo collectives {label}"] = _collectives_case(group, staged)
        for label, group in groups.items():
            for causal in (True, False):
                name = f"torch-flash llama3 {label} causal={causal} heads_k_stride=2"
                results[name] = _llama3_case(ring, data, group, causal, 2)
            results[f"torch-flash zigzag-bf16 {label}"] = _zigzag_case(ring, data, group, torch.bfloat16)
        # Every rank compared the gathered tensors; report the worst over ranks.
        items = sorted((name, key) for name, errors in results.items() for key in errors)
        worst = torch.tensor([results[name][key] for name, key in items], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            table: dict[str, dict[str, float]] = {}
            for (name, key), value in zip(items, worst.tolist(), strict=True):
                table.setdefault(name, {})[key] = value
            Path(result_path).write_text(json.dumps(table, indent=1))
    finally:
        close_process_groups()  # as cptune's own ranks end


def _launch(out_dir: Path) -> None:
    """Import once, then fork the workers of each world size; exit non-zero if any fails."""
    _import_ring_flash_attn()
    reorder.apply()  # CPTUNE_TEST_REORDER=1: other summation orders (tests/reorder.py), inherited
    # fork, not spawn: the children inherit the imports. Nothing here has started a thread pool
    # or a process group yet, which is what makes forking safe.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    for world_size in WORLD_SIZES:
        store, result = out_dir / f"store{world_size}", out_dir / f"world{world_size}.json"
        workers = [
            context.Process(target=_worker, args=(rank, world_size, str(store), str(result)))
            for rank in range(world_size)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(TIMEOUT_S / 2)
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
        codes = [worker.exitcode for worker in workers]
        if any(codes):
            sys.exit(f"world {world_size}: worker exit codes {codes}")


if __name__ == "__main__":
    _launch(Path(sys.argv[1]))
