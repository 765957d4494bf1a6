"""cp_backend: deepspeed parity on CPU: DeepSpeed Ulysses + ZeRO runs equal the cp=1 run (invariants 1-5).

Three cases run cptune's ring-flash-attn (ZeRO-3, with the tiled MLP and the chunked loss) and torch
(ZeRO-2) backends under DeepSpeed's engine instead of Ulysses (``ring`` in the worker).

Each case runs 3 optimizer steps (SGD) on the tiny Llama (4 query heads) through
DeepSpeed's own Ulysses attention and engine, with cptune's sharding, backend, target count
and loss scale, and compares with the cp=1 reference from the same model, data and seeds: the
Trainer's logged loss, the gradients DeepSpeed hands the optimizer (after its reduction across
all ranks), and the losses after each step. fp32, held to the float64-reference rule of
tests/parallel/test_parity.py's ``check``: at most 32x as far from the cp=1 reference computed in
float64 as the farthest of the fp32 cp=1 reference and its fp32 reorder twins lands (wider where fewer of those
are distinct, tests/numerics.py's ``TWINS_FACTORS``). Every ZeRO-3 case partitions every
parameter over the ranks (``stage3_param_persistence_threshold: 0``; the default keeps all of the
tiny model's parameters whole), which the test checks.

Preference (DPO/IPO) cases train pairs with LoRA through the same engine (ulysses_preference_case.py): the
losses, step-0 gradients and step-0 DPO metrics of the cp=1 run, by the same rule.

Core attention: ``cptune`` (document-aware, the default) for packed and
bidirectional rows; ``sdpa`` for unpacked causal rows (the recipe refuses packed
rows with sdpa: tests/config/test_loader.py).
bf16 cases (``BF16_CP2_CASES``) run DeepSpeed's bf16 engine with each memory feature on, held to the bf16
reorder-floor check of test_parity.py, ZeRO-3 with recomputed norms among them.
Sliding-window models (a tiny Mistral and Gemma 3 text, ``WINDOW_CP2_CASES`` and the cp4 window
cases) run through the ``cptune`` core attention, which attends each layer's window over whole rows,
and so does a tiny gpt-oss (``SINK_CP2_CASES``, and at cp=4 one query head per rank), whose sinks each rank
applies for its heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_utils import run_ranks
from tests.parallel.test_parity import check, preference_metric_failures

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

WORKER = Path(__file__).with_name("ulysses_parity_worker.py")

# Axolotl's ALST recipe's memory features: tiled MLP (3 tiles) and the chunked loss (CutCrossEntropyPlugin).
ALST = {"tiles": 3, "head_loss": True}
BASE = {"cp": 2, "packed": True, "causal": True, "lora": True, "mbs": 1, "ga": 1, "seq_len": 24, "seed": 11}


def case(name: str, **changes) -> dict:
    return {**BASE, "name": name, **changes}


CP2_CASES = [
    case("packed-causal-lora"),
    case("packed-bidirectional-full", causal=False, lora=False),
    case("unpacked-causal-lora-sdpa", packed=False, core="sdpa"),
    case("mbs2-ga3-unpacked-full-sdpa", packed=False, lora=False, core="sdpa", mbs=2, ga=3),
    case("odd-length-23-one-shard-without-targets", seq_len=23, empty_shard=True),
    case("zero1-mbs2-ga2-packed-lora", stage=1, mbs=2, ga=2),
    case("zero2-ga2-packed-full", stage=2, lora=False, ga=2),
    case("zero3-ga2-packed-lora", stage=3, ga=2),
    # Without reduce-scatter ZeRO-3 averages the gradient buckets by another path (stage3.py:1673-1679); with a
    # sequence-parallel group (cptune's Ulysses once had one) that path divided by W/C and the other by W.
    case("zero3-no-reduce-scatter-ga2-packed-lora", stage=3, ga=2, zero={"reduce_scatter": False}),
    # QLoRA (4-bit NF4 base, bitsandbytes) under ZeRO-3 (issue 20).
    case("qlora-zero3-ga2-packed", stage=3, ga=2, qlora=True),
    # cp_backend ring-flash-attn / torch under DeepSpeed's ZeRO, as Axolotl's ALST recipe (issue 20), with
    # its tiled MLP and chunked loss: both call modules again in the backward pass, after ZeRO-3 freed
    # their weights (the dp2xcp2 ZeRO-3 case below reduces the MLP's and the output layer's weights too).
    case("ring-zero3-ga2-packed-lora+tiles+head-loss", stage=3, ga=2, ring="ring-flash-attn", features=ALST),
    # Chunks of 3 tokens: the two ranks' shards hold different numbers of targets, so a different number of
    # chunks, and each chunk's head call gathers ZeRO-3's partitioned head weight (a collective). Before the
    # chunk counts were agreed over the partition group, gloo aborted ("Received data size doesn't match").
    case(
        "ring-zero3-ga2-packed-lora+head-loss-in-3-token-chunks",
        stage=3,
        ga=2,
        ring="ring-flash-attn",
        features={"head_loss": True, "head_loss_chunk": 3 * 97},
    ),
    case("torch-zero2-unpacked-full", stage=2, packed=False, lora=False, ring="torch"),
    # Memory features on (tests/parallel/case_features.py), off in the cp=1 reference; the offload case
    # repeats packed-causal-lora and must match it bit for bit.
    case("packed-causal-lora+offload", features={"offload": True}),
    case("packed-causal-lora+all-features", features={"offload": True, "tiles": 3, "head_loss": True}),
    case(
        "packed-bidirectional-full+all-features",
        causal=False,
        lora=False,
        features={"offload": True, "tiles": 2, "head_loss": True},
    ),
]
# Preference training (rl) with LoRA: packed pairs (two documents per pair in a row) through the document-aware
# core attention; unpacked pairs as a row per side (Recipe.pair_sides_in_own_rows), also through sdpa.
PREFERENCE_CP2_CASES = [
    case("pref-dpo-packed-mbs2-ga2", preference="dpo", mbs=2, ga=2),
    case("pref-ipo-unpacked-sdpa-mbs2", preference="ipo", packed=False, core="sdpa", mbs=2),
    case("pref-dpo-unpacked-ga2", preference="dpo", packed=False, ga=2),
    # A full fine-tune (precompute_ref_log_probs): the reference sums from the engine's model before step 0.
    case(
        "pref-dpo-full-precomputed-packed-mbs2-ga2",
        preference="dpo",
        lora=False,
        precompute=True,
        mbs=2,
        ga=2,
    ),
]
# ZeRO-1 (optimizer states partitioned) and ZeRO-2 (gradients too) over the 2 ranks.
PREFERENCE_CP2_CASES += [
    case("pref-zero1-dpo-packed-mbs2", preference="dpo", stage=1, mbs=2),
    case(
        "pref-zero2-dpo-full-precomputed-unpacked-ga2",
        preference="dpo",
        stage=2,
        lora=False,
        precompute=True,
        packed=False,
        ga=2,
    ),
]
PREFERENCE_CP4_CASES = [case("pref-cp4-dpo-packed-mbs2-kv2", preference="dpo", cp=4, mbs=2)]
PREFERENCE_DP2_CP2_CASES = [case("pref-dp2xcp2-dpo-packed-mbs2-ga2", preference="dpo", mbs=2, ga=2)]
# The reference-free losses: no reference forward, per-token means.
PREFERENCE_CP2_CASES += [case("pref-orpo-unpacked-ga2", preference="orpo", packed=False, ga=2)]
PREFERENCE_CP4_CASES += [case("pref-cp4-simpo-packed-mbs2", preference="simpo", cp=4, mbs=2)]
PREFERENCE_DP2_CP2_CASES += [case("pref-dp2xcp2-simpo-packed-ga2", preference="simpo", ga=2)]
# Sliding-window layers through the cptune core attention (whole rows per head group after the all-to-all):
# a tiny Mistral (a window of 5 keys on every layer) and Gemma 3 text (sliding, sliding, full); packed rows
# of 3 short documents and one long one wider than the window (tests/parallel/test_parity.py).
WINDOW_CP2_CASES = [
    case("window-mistral-packed-causal-lora", arch="mistral", long_doc=True),
    case("window-mistral-ga2-packed-causal-full", arch="mistral", long_doc=True, lora=False, ga=2),
    case("window-gemma3-packed-causal-lora", arch="gemma3", long_doc=True),
    case("window-gemma3-packed-causal-full", arch="gemma3", long_doc=True, lora=False),
]
# Attention sinks: a tiny gpt-oss (a sink logit per head in every layer; sliding then full layers; 4 experts, its
# router loss on) through the cptune core attention, each rank applying the sinks of its block of heads after
# the all-to-all; the cp=1 reference is transformers' eager gpt-oss attention (tests/parallel/test_parity.py).
SINK_CP2_CASES = [
    case("sinks-gpt-oss-packed-causal-lora", arch="gpt_oss", long_doc=True),
    case("sinks-gpt-oss-ga2-packed-causal-full", arch="gpt_oss", long_doc=True, lora=False, ga=2),
]
# A tiny Qwen3-MoE with its router loss (tests/parallel/parity_worker.py's MoE cases): the router sums
# all-reduced over the CP group, whose ranks hold contiguous halves of the rows in the MoE layers.
MOE_CP2_CASES = [
    case("moe-packed-causal-full-mbs2-ga2", arch="qwen3_moe", lora=False, mbs=2, ga=2),
    # LoRA on the attention, the routers and the experts' fused weights, partitioned by ZeRO-3.
    case("moe-zero3-ga2-packed-lora", arch="qwen3_moe", stage=3, ga=2),
    case("mixtral-packed-causal-lora", arch="mixtral"),
]
# bf16 as `cptune train` runs it under DeepSpeed (``bf16.enabled``: the engine casts every parameter to bf16,
# LoRA adapters too, and steps fp32 master weights; no autocast, so peft's LoRA input cast that cptune skips
# under autocast is a no-op here), each memory feature on at cp=2, off in the cp=1 references (tests/parallel/
# case_features.py), held to check(bf16=True): the reorder floor of the bf16 cp=1 reference's reorder twins
# (tests/parallel/reorder_twins.py; issue 30). The offload case must equal its twin without offloading bit for bit.
BF16_FEATURES = {"offload": True, "tiles": 3, "norms": True, "head_loss": True}
BF16_CP2_CASES = [
    case("bf16-packed-causal-lora", bf16=True),
    case("bf16-packed-causal-lora+offload", bf16=True, features={"offload": True}),
    case("bf16-packed-causal-lora+all-features", bf16=True, features=BF16_FEATURES),
    case("bf16-packed-causal-full+all-features", bf16=True, lora=False, features=BF16_FEATURES),
    # ZeRO-3 partitions the norms' weights: the recomputed norm's backward runs while ZeRO-3 holds its weight
    # whole for the norm's backward, and hands the trained weight its gradient then (zero3_params.gathered).
    case(
        "bf16-zero3-ga2-packed-full+all-features",
        bf16=True,
        stage=3,
        ga=2,
        lora=False,
        features=BF16_FEATURES,
    ),
]
CP4_CASES = [
    # 2 key/value heads over 4 ranks: DeepSpeed replicates them.
    case("cp4-packed-causal-lora-kv2", cp=4, seq_len=30, ga=2),
    case("cp4-mbs2-unpacked-full-sdpa-kv4", cp=4, packed=False, lora=False, core="sdpa", kv_heads=4, mbs=2),
    case("cp4-window-mistral-packed-causal-lora", cp=4, arch="mistral", long_doc=True, seq_len=32),
    case(
        "cp4-window-mistral-packed-causal-full", cp=4, arch="mistral", long_doc=True, lora=False, seq_len=32
    ),
    # gpt-oss over 4 ranks: one query head each, so each rank applies exactly one head's sink.
    case("cp4-sinks-gpt-oss-packed-causal-lora", cp=4, arch="gpt_oss", long_doc=True, seq_len=32),
    case("cp4-window-gemma3-packed-causal-lora", cp=4, arch="gemma3", long_doc=True, seq_len=32),
    case("cp4-moe-packed-causal-full", cp=4, arch="qwen3_moe", lora=False, seq_len=32),
    case("cp4-mixtral-packed-causal-lora", cp=4, arch="mixtral", seq_len=32),
]
DP2_CP2_CASES = [
    case("dp2xcp2-mbs2-ga2-packed-lora", mbs=2, ga=2),
    # Ulysses with ZeRO-3, the tiled MLP and the chunked loss, full fine-tune (issue 20).
    case(
        "dp2xcp2-zero3-ga2-unpacked-full-sdpa+tiles+head-loss",
        packed=False,
        lora=False,
        core="sdpa",
        stage=3,
        ga=2,
        features={"tiles": 2, "head_loss": True},
    ),
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "cases"),
    [
        (
            2,
            CP2_CASES
            + PREFERENCE_CP2_CASES
            + WINDOW_CP2_CASES
            + MOE_CP2_CASES
            + BF16_CP2_CASES
            + SINK_CP2_CASES,
        ),
        (4, CP4_CASES + DP2_CP2_CASES + PREFERENCE_CP4_CASES + PREFERENCE_DP2_CP2_CASES),
    ],
    ids=["cp2", "cp4-and-dp2xcp2"],
)
def test_ulysses_parity_fp32(tmp_path, world, cases):
    # One launch per world size: process start-up dominates these runs on CPU.
    results = run_ranks(WORKER, world, tmp_path, json.dumps(cases))
    check(results, [c for c in cases if not c.get("bf16")])  # float64 reference (tests/numerics.py)
    check(results, [c for c in cases if c.get("bf16")], bf16=True)  # reorder floor of the same run
    for name in (c["name"] for c in cases if c.get("preference")):  # and the DPO metrics of step 0
        for rank, per_rank in enumerate(results):
            failures = preference_metric_failures(per_rank[name])
            assert not failures, (name, rank, failures, per_rank[name]["cp_metrics"])
    for name in (c["name"] for c in cases if c.get("arch") == "qwen3_moe"):
        for per_rank in results:
            r = per_rank[name]
            # The logged router_aux_loss against the float64 cp=1 value, by test_parity.py's bound for
            # it (fp32 sums of at most 192 terms of magnitude <= 1, twice): 4e-5.
            errors = [abs(a - b) / b for a, b in zip(r["cp_router_aux"], r["ref64_router_aux"], strict=True)]
            assert len(errors) == 3 and max(errors) <= 4e-5, (name, errors)
    names = {c["name"] for c in cases}
    for name in (c["name"] for c in cases if c.get("stage") == 3):  # ZeRO-3 really splits every parameter
        for per_rank in results:
            assert per_rank[name]["parameters"] > 0 and per_rank[name]["whole_parameters"] == [], name
    for prefix in ("", "bf16-"):  # offloading changes no bit of the CP run
        if f"{prefix}packed-causal-lora+offload" not in names:
            continue
        for per_rank in results:
            twin, offloaded = (
                per_rank[f"{prefix}packed-causal-lora"],
                per_rank[f"{prefix}packed-causal-lora+offload"],
            )
            assert (offloaded["cp_losses"], offloaded["grad_sha"]) == (twin["cp_losses"], twin["grad_sha"])


# quantize_moe_experts: QLoRA on a Qwen3-MoE whose expert tensors are packed in 4 bits too, on DeepSpeed's engine
# without ZeRO sharding (cptune refuses the key with deepspeed / zero_stage: the packed experts are not built to
# be partitioned).
PACKED_EXPERTS_CP2_CASES = [
    case("qlora-moe-packed-experts-packed", arch="qwen3_moe", qlora=True, moe_experts=True)
]


@pytest.mark.distributed
def test_ulysses_packed_moe_experts_parity_fp32(tmp_path):
    """The losses of 3 SGD steps and the step-0 gradients of the cp=1 run of the same packed model, by the
    float64 rule (the float64 reference reads the packed experts' dequantized values in float64)."""
    results = run_ranks(WORKER, 2, tmp_path, json.dumps(PACKED_EXPERTS_CP2_CASES))
    check(results, PACKED_EXPERTS_CP2_CASES)
