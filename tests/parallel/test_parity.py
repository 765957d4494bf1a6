"""CP parity on CPU: context-parallel runs equal the cp=1 run (DESIGN.md, invariants 1-5).

Each case runs 3 optimizer steps (AdamW) on the tiny Llama through cptune's
sharding, a CP backend and the token-weighted loss, and compares with the cp=1
reference computed from the same model, data and seeds. fp32 with varlen_llama3
and with the torch backend: step-0 loss rel <= 1e-5, gradients max rel <= 1e-4,
losses of the 3 steps rel <= 1e-4. batch_zigzag runs in bf16 (ring-flash-attn
0.1.8's zigzag backward is wrong in fp32), compared with a bf16 reference: loss
rel <= 2e-2, gradients max rel <= 1e-1 (bf16 has 8 bits of mantissa).

Spawning gloo processes dominates the time, so one spawn per world size runs the
cases of both backends; each backend's test reads its cases from that spawn.
Torch cases are unpacked (torch's CP attention takes no document mask and
refuses packed rows); their causal rows carry trailing padding, which causal
attention never shows to a trained token, and their bidirectional rows are one
document each (``full_rows``), the only exact case without a mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_utils import run_ranks

WORKER = Path(__file__).with_name("parity_worker.py")

BASE = {"packed": True, "causal": True, "lora": True, "mbs": 1, "ga": 1, "seq_len": 24, "seed": 11}


def case(name: str, **changes) -> dict:
    return {**BASE, "name": name, **changes}


CP2_CASES = [
    case("packed-causal-lora"),
    case("packed-causal-full", lora=False),
    case("packed-bidirectional-lora", causal=False),
    case("unpacked-causal-full", packed=False, lora=False),
    case("unpacked-bidirectional-full", packed=False, causal=False, lora=False),
    case("mbs2-ga2-packed-lora", mbs=2, ga=2),
    case("odd-length-23-unpacked", packed=False, seq_len=23),
    case("heads-k-stride-2", heads_k_stride=2, kv_heads=2),
    case("one-shard-without-targets", empty_shard=True),
    # QLoRA: the base's linear layers in 4-bit NF4 (bitsandbytes), LoRA on top (issue 20).
    case("qlora-packed-causal", qlora=True),
]
CP4_CASES = [
    case("packed-causal-lora", seq_len=30),
    case("packed-bidirectional-full", seq_len=30, causal=False, lora=False),
    case("mbs2-ga2-unpacked-full", packed=False, lora=False, mbs=2, ga=2, seq_len=21),
]
DP2_CP2_CASES = [
    case("packed-causal-lora", mbs=2, ga=2),
    case("unpacked-bidirectional-full", packed=False, causal=False, lora=False),
]
ZIGZAG_CASES = [
    case("zigzag-bf16-causal-lora", packed=False, func="batch_zigzag", bf16=True, seq_len=22),
    case(
        "zigzag-bf16-mbs2-full", packed=False, func="batch_zigzag", bf16=True, lora=False, mbs=2, seq_len=32
    ),
]


def torch_case(name: str, **changes) -> dict:
    return case(f"torch-{name}", backend="torch", packed=False, **changes)


# load_balance defaults to causal (as cp_load_balance: null), comm to allgather.
TORCH_CP2_CASES = [
    torch_case("causal-lora"),
    torch_case("causal-full-alltoall", lora=False, comm="alltoall"),
    torch_case("causal-lora-no-load-balance", load_balance=False),
    torch_case("bidirectional-lora", causal=False, full_rows=True),
    torch_case("bidirectional-full-mbs2-ga2", causal=False, full_rows=True, lora=False, mbs=2, ga=2),
    torch_case("causal-lora-mbs2-ga2", mbs=2, ga=2),
    torch_case("odd-length-23-full", seq_len=23, lora=False),
    torch_case("one-shard-without-targets", empty_shard=True, full_rows=True, load_balance=False),
]
TORCH_CP4_CASES = [
    torch_case("causal-lora", seq_len=30),
    torch_case("bidirectional-full", causal=False, full_rows=True, lora=False, seq_len=32),
    torch_case("causal-full-mbs2-ga2-alltoall", lora=False, mbs=2, ga=2, seq_len=21, comm="alltoall"),
]
TORCH_DP2_CP2_CASES = [
    torch_case("causal-lora-mbs2-ga2", mbs=2, ga=2),
    torch_case("bidirectional-full", causal=False, full_rows=True, lora=False),
]

# Memory features (tests/parallel/case_features.py) on the CP model, off in the cp=1 reference. Each
# offload-only case repeats a case above with the same data and seeds: its CP run is compared with
# that case's bit for bit (FEATURE_TWINS).
ALL_FEATURES = {"offload": True, "tiles": 3, "head_loss": True}
FEATURE_CP2_CASES = [
    case("packed-causal-lora+offload", features={"offload": True}),
    case("packed-causal-full+offload", lora=False, features={"offload": True}),
    case("packed-causal-lora+all-features", features=ALL_FEATURES),
    case("unpacked-causal-full+all-features", packed=False, lora=False, features=ALL_FEATURES),
    torch_case("causal-lora+offload", features={"offload": True}),
    torch_case("causal-full-alltoall+offload", lora=False, comm="alltoall", features={"offload": True}),
    torch_case("causal-lora+all-features", features=ALL_FEATURES),
    torch_case("causal-full-alltoall+all-features", lora=False, comm="alltoall", features=ALL_FEATURES),
]
FEATURE_TWINS = {
    c["name"]: c["name"].split("+")[0] for c in FEATURE_CP2_CASES if c["features"] == {"offload": True}
}

# spawn id -> (world size, cp size, cases of every backend run in that spawn)
SPAWNS = {
    "cp2": (2, 2, CP2_CASES + TORCH_CP2_CASES + FEATURE_CP2_CASES),
    "cp4": (4, 4, CP4_CASES + TORCH_CP4_CASES),
    "dp2xcp2": (4, 2, DP2_CP2_CASES + TORCH_DP2_CP2_CASES),
}


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory):
    """``parity_results(spawn_id)``: every rank's results of that spawn, run once per module."""
    done: dict[str, list[dict] | AssertionError] = {}

    def results(spawn: str) -> list[dict]:
        if spawn not in done:
            world, cp, cases = SPAWNS[spawn]
            try:
                done[spawn] = run_ranks(
                    WORKER, world, tmp_path_factory.mktemp(spawn), str(cp), json.dumps(cases)
                )
            except AssertionError as failure:  # reported by every test of the spawn, run once
                done[spawn] = failure
        if isinstance(done[spawn], AssertionError):
            raise done[spawn]
        return done[spawn]

    return results


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def check(results: list[dict], cases: list[dict], loss_tol: float, step0_tol: float, grad_tol: float) -> None:
    for name in (c["name"] for c in cases):
        for rank, per_rank in enumerate(results):
            r = per_rank[name]
            assert r["grad_nonzero"], f"{name}: reference gradients are zero, the check would be vacuous"
            assert rel(r["cp_losses"][0], r["ref_losses"][0]) <= step0_tol, (name, rank, r)
            assert r["grad_rel"] <= grad_tol, (name, rank, r["grad_rel"])
            for cp_loss, ref_loss in zip(r["cp_losses"], r["ref_losses"], strict=True):
                assert rel(cp_loss, ref_loss) <= loss_tol, (name, rank, r)
            # the run must actually train: the three losses are not all equal
            assert len(set(r["ref_losses"])) > 1


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"),
    [("cp2", CP2_CASES), ("cp4", CP4_CASES), ("dp2xcp2", DP2_CP2_CASES)],
    ids=["cp2", "cp4", "dp2xcp2"],
)
def test_varlen_llama3_parity_fp32(parity_results, spawn, cases):
    check(parity_results(spawn), cases, loss_tol=1e-4, step0_tol=1e-5, grad_tol=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"),
    [("cp2", TORCH_CP2_CASES), ("cp4", TORCH_CP4_CASES), ("dp2xcp2", TORCH_DP2_CP2_CASES)],
    ids=["cp2", "cp4", "dp2xcp2"],
)
def test_torch_parity_fp32(parity_results, spawn, cases):
    check(parity_results(spawn), cases, loss_tol=1e-4, step0_tol=1e-5, grad_tol=1e-4)


@pytest.mark.distributed
def test_zigzag_parity_bf16(tmp_path):
    results = run_ranks(WORKER, 2, tmp_path, "2", json.dumps(ZIGZAG_CASES))
    check(results, ZIGZAG_CASES, loss_tol=2e-2, step0_tol=2e-2, grad_tol=1e-1)


@pytest.mark.distributed
def test_memory_features_parity_cp2(parity_results):
    """Offloading, tiled MLP and the chunked head loss on at cp=2 (ring and torch), off at cp=1.

    Offloading changes no bit: each offload case's CP losses and step-0 gradients equal its twin's
    without offloading. With every feature on, the fp32 parity tolerances hold.
    """
    results = parity_results("cp2")
    check(results, FEATURE_CP2_CASES, loss_tol=1e-4, step0_tol=1e-5, grad_tol=1e-4)
    for per_rank in results:
        for name, twin in FEATURE_TWINS.items():
            assert per_rank[name]["cp_losses"] == per_rank[twin]["cp_losses"], (name, twin)
            assert per_rank[name]["grad_sha"] == per_rank[twin]["grad_sha"], (name, twin)
