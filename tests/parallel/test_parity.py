"""CP parity on CPU: context-parallel runs equal the cp=1 run (DESIGN.md, invariants 1-5).

Each case runs 3 optimizer steps (SGD, whose update is linear in the gradient) on
the tiny Llama through cptune's sharding, a CP backend, exact LoRA dropout where
the case asks for it, and the token-weighted loss, and compares with the cp=1
reference computed from the same model, data and seeds. fp32 with varlen_llama3
and with the torch backend: against the cp=1 reference computed in float64, the
CP run's losses and gradients at most 32x as far from it as the farthest of the
fp32 cp=1 reference and its 2 fp32 reorder twins, each twin computed on one rank
(tests/numerics.py's ``FP32_TWINS_FACTOR``; wider where fewer of them are distinct, ``TWINS_FACTORS``;
``fp32_excesses``). batch_zigzag runs in bf16
(ring-flash-attn 0.1.8's zigzag backward is wrong in fp32), compared with a bf16
reference within a multiple of the reorder floor measured in the same run (the cp=1
reference computed again in 3 other legal orders: ``bf16_excesses``).
Planted bugs (a wrong gradient scale, a sliding window, a dropped document
boundary) must fail the fp32 check (``test_planted_bugs_fail_the_fp32_parity_check``).

Spawning gloo processes dominates the time, so one spawn per world size runs the
cases of both backends (and, at cp=2, the bf16 zigzag cases); each test reads its
cases from that spawn.
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
from tests.numerics import (
    ULP_FLOOR,
    distinct_draws,
    float64_scalar_twins_excess,
    float64_twins_excess,
    loss_sum_floor,
)

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
    # Exact LoRA dropout: each rank draws its slice of the masks cp=1 draws.
    case("packed-causal-lora-dropout", dropout=0.1),
]
CP4_CASES = [
    case("packed-causal-lora", seq_len=30),
    case("packed-bidirectional-full", seq_len=30, causal=False, lora=False),
    case("mbs2-ga2-unpacked-full", packed=False, lora=False, mbs=2, ga=2, seq_len=21),
    case("mbs2-ga2-packed-lora-dropout", seq_len=30, mbs=2, ga=2, dropout=0.1),
]
DP2_CP2_CASES = [
    case("packed-causal-lora", mbs=2, ga=2),
    case("packed-causal-lora-dropout", mbs=2, ga=2, dropout=0.1),
    case("unpacked-bidirectional-full", packed=False, causal=False, lora=False),
]
# Tensor parallelism (tensor_parallel_size: 2) × cp=2 on the same 4 processes, under FSDP2 over the
# 2 cp ranks, as `cptune train` runs it: full fine-tunes (adapters are refused with tp).
TP2_CP2_CASES = [
    case("tp2-packed-causal-full-mbs2-ga2", tp=2, lora=False, mbs=2, ga=2),
    case("tp2-unpacked-bidirectional-full", tp=2, packed=False, causal=False, lora=False),
    # Axolotl's fsdp-tp-cp recipe loads CutCrossEntropyPlugin: the chunked loss through the split head.
    case("tp2-packed-causal-full+head-loss", tp=2, lora=False, features={"head_loss": True}),
    # Qwen3 (the recipe's family): per-head q_norm/k_norm, whose gradients are summed over the tp ranks.
    case("tp2-qwen3-packed-causal-full-mbs2-ga2", tp=2, arch="qwen3", lora=False, mbs=2, ga=2),
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
    # Dropout over torch's head-tail (zigzag) order and over contiguous slices.
    torch_case("causal-lora-dropout", dropout=0.1),
    torch_case("bidirectional-lora-dropout", causal=False, full_rows=True, dropout=0.1),
]
TORCH_CP4_CASES = [
    torch_case("causal-lora", seq_len=30),
    torch_case("causal-lora-dropout-mbs2-ga2", seq_len=30, mbs=2, ga=2, dropout=0.1),
    torch_case("bidirectional-full", causal=False, full_rows=True, lora=False, seq_len=32),
    torch_case("causal-full-mbs2-ga2-alltoall", lora=False, mbs=2, ga=2, seq_len=21, comm="alltoall"),
]
TORCH_DP2_CP2_CASES = [
    torch_case("causal-lora-mbs2-ga2", mbs=2, ga=2),
    torch_case("bidirectional-full", causal=False, full_rows=True, lora=False),
]

# Bugs planted in the CP path (parity_worker.py's ``inject``): the fp32 check must fail on each. The
# window is a sliding window of 8 keys over unpacked rows (documents of 12 to 24 tokens); the
# boundary is the first document boundary of the rows, dropped from the attention's cu_seqlens.
PLANTED_CASES = [
    case("planted-grad-scale", inject="grad_scale"),
    case("planted-window", inject="window", packed=False, lora=False),
    case("planted-boundary", inject="boundary", lora=False),
    # Each rank's router loss from its own shard's tokens, not summed over the CP group.
    case("planted-router-local", inject="router_local", arch="qwen3_moe", lora=False),
    # Mistral's sliding windows counted in shard-local positions (no window reaches back across a shard
    # boundary), and not passed to the kernel at all.
    case(
        "planted-window-shard-local", inject="window_shard_local", arch="mistral", long_doc=True, lora=False
    ),
    case("planted-window-dropped", inject="window_dropped", arch="mistral", long_doc=True, lora=False),
    # gpt-oss's sink logits not applied, and applied to each rank's block of keys before the merge (so once per
    # block): the sinks train in these full fine-tunes.
    case("planted-sinks-dropped", inject="sinks_dropped", arch="gpt_oss", long_doc=True, lora=False),
    case("planted-sinks-per-block", inject="sinks_per_block", arch="gpt_oss", long_doc=True, lora=False),
    # gpt-oss on the zigzag ring with the sink put into each block of the ring before the merge.
    case(
        "planted-zigzag-sinks-per-block",
        inject="zigzag_sinks_per_block",
        arch="gpt_oss",
        packed=False,
        full_rows=True,
        func="batch_zigzag",
        lora=False,
    ),
]

# Sliding-window layers (ring-flash-attn's varlen_llama3, causal): a tiny Mistral with a window of 5 keys on
# every layer, and a tiny Gemma 3 text model (sliding, sliding, full). Packed rows hold 3 short documents
# and one long document over the last two thirds of the row, wider than the window and crossing every
# shard boundary; unpacked rows hold one document of 12 to 24 tokens. The cp=1 reference is transformers'
# own sdpa with its sliding-window mask (tests/parallel/backends/test_sliding_window.py checks it against
# eager attention document by document).
WINDOW_CP2_CASES = [
    case("window-mistral-packed-causal-lora", arch="mistral", long_doc=True),
    case(
        "window-mistral-packed-causal-full-mbs2-ga2", arch="mistral", long_doc=True, lora=False, mbs=2, ga=2
    ),
    case("window-mistral-unpacked-causal-full", arch="mistral", packed=False, lora=False),
    case("window-gemma3-packed-causal-lora", arch="gemma3", long_doc=True),
    case("window-gemma3-packed-causal-full", arch="gemma3", long_doc=True, lora=False),
]
WINDOW_CP4_CASES = [
    case("window-mistral-packed-causal-lora", arch="mistral", long_doc=True, seq_len=32),
    case("window-mistral-packed-causal-full", arch="mistral", long_doc=True, lora=False, seq_len=32),
    # Gemma 3's mixed layers over 4 shards: the long document crosses three shard boundaries.
    case("window-gemma3-packed-causal-lora", arch="gemma3", long_doc=True, seq_len=32),
]
# Sliding windows on the zigzag ring (batch_zigzag, window 5; unpacked rows of one document of 12 to 24 tokens
# then padding), through cptune's own zigzag ring for windowed layers (ring_flash_attn/zigzag_window.py).
# Mistral (every layer windowed) in fp32 by the float64 rule: that ring is exact in fp32. Gemma 3's full layers
# take ring-flash-attn's zigzag function, wrong in fp32 (the recipe requires bf16): bf16, reorder floor.
ZIGZAG_WINDOW_CP2_CASES = [
    case("zigzag-window-mistral-full", arch="mistral", packed=False, func="batch_zigzag", lora=False),
    case("zigzag-window-mistral-lora-mbs2", arch="mistral", packed=False, func="batch_zigzag", mbs=2),
]
ZIGZAG_WINDOW_BF16_CP2_CASES = [
    case(
        "zigzag-window-gemma3-bf16-full",
        arch="gemma3",
        packed=False,
        func="batch_zigzag",
        bf16=True,
        lora=False,
    )
]
# Gemma 3 at cp=4 on the zigzag ring: 4 ranks' blocks, windows crossing chunk boundaries, its full layers on
# ring-flash-attn's zigzag function (bf16, reorder floor, as at cp=2).
ZIGZAG_WINDOW_BF16_CP4_CASES = [
    case(
        "zigzag-window-gemma3-bf16-full",
        arch="gemma3",
        packed=False,
        func="batch_zigzag",
        bf16=True,
        lora=False,
        seq_len=32,
    )
]
ZIGZAG_WINDOW_CP4_CASES = [
    case(
        "zigzag-window-mistral-full",
        arch="mistral",
        packed=False,
        func="batch_zigzag",
        lora=False,
        seq_len=32,
    )
]
# The window handed to ring-flash-attn's zigzag function, which aligns it to each block: the bf16 check fails.
ZIGZAG_WINDOW_PLANTED_CASES = [
    case(
        "planted-zigzag-window-block-local",
        inject="zigzag_window_block_local",
        arch="mistral",
        packed=False,
        func="batch_zigzag",
        bf16=True,
        lora=False,
    )
]

# Attention sinks: a tiny gpt-oss (a learned sink logit per head in every layer's softmax; sliding then full
# layers, a window of 5 keys; 4 experts, 2 per token, its router loss on), on ring-flash-attn's varlen_llama3,
# the sinks applied once to each query's merged attention. Packed rows of 3 short documents and one long one
# (as the window cases). The cp=1 reference is transformers' eager gpt-oss attention given the documents'
# masks (tests/parallel/masked_eager.py; tests/parallel/backends/test_attention_sinks.py checks it against
# the model run on each document alone).
SINK_CP2_CASES = [
    case("sinks-gpt-oss-packed-causal-lora", arch="gpt_oss", long_doc=True),
    case("sinks-gpt-oss-packed-causal-full-mbs2-ga2", arch="gpt_oss", long_doc=True, lora=False, mbs=2, ga=2),
]
SINK_CP4_CASES = [
    case("sinks-gpt-oss-packed-causal-lora", arch="gpt_oss", long_doc=True, seq_len=32),
    case("sinks-gpt-oss-packed-causal-full", arch="gpt_oss", long_doc=True, lora=False, seq_len=32),
]
# gpt-oss on the zigzag ring (batch_zigzag): cptune's ring on every layer (each has sinks; sliding and full),
# the sink applied once to the ring's merged (out, lse); exact in fp32, so by the float64 rule. Whole rows of one
# document (full_rows): the zigzag ring has no documents, and padding it let see the row would route otherwise
# than at cp=1 under gpt-oss's router loss (cptune refuses padded rows there: router_padding.py).
SINK_ZIGZAG_CP2_CASES = [
    case(
        "zigzag-sinks-gpt-oss-full",
        arch="gpt_oss",
        packed=False,
        full_rows=True,
        func="batch_zigzag",
        lora=False,
    ),
]
SINK_ZIGZAG_CP4_CASES = [
    case(
        "zigzag-sinks-gpt-oss-lora",
        arch="gpt_oss",
        packed=False,
        full_rows=True,
        func="batch_zigzag",
        seq_len=32,
    ),
]

# Mixture of experts: a tiny Qwen3-MoE (every layer sparse, 4 experts, 2 per token) with its router's
# load-balancing loss on (output_router_logits, router_aux_loss_coef 0.02), fully fine-tuned so the
# routers train. The unpacked rows of 23 tokens end in collator padding (counted, as transformers
# counts it without an attention mask) and get a CP padding token (not counted: cp=1 has none).
MOE_CP2_CASES = [
    case("moe-packed-causal-full-mbs2-ga2", arch="qwen3_moe", lora=False, mbs=2, ga=2),
    # LoRA all-linear: peft wraps the attention projections, the routers and the experts' weights; the
    # router loss trains the routers' adapters too.
    case("moe-packed-causal-lora", arch="qwen3_moe"),
    # Mixtral's own router (num_local_experts) on the ring, fully fine-tuned so its router trains.
    case("mixtral-packed-causal-full", arch="mixtral", lora=False),
]
# torch's CP attention (no document mask) with whole rows, so no padding the router loss counts (the padding
# CP adds is left out); a tiny Mixtral too (num_local_experts, its own router), with LoRA on its experts.
MOE_TORCH_CP2_CASES = [
    torch_case("moe-full-rows-full-mbs2-ga2", arch="qwen3_moe", full_rows=True, lora=False, mbs=2, ga=2),
    torch_case("mixtral-full-rows-lora", arch="mixtral", full_rows=True),
]
# Rows ending in padding (a document of its own, counted by the router loss): torch's attention lets the
# padding see the row's real tokens, so its routing and the router loss are not cp=1's. cptune refuses
# this (cptune.parallel.router_padding); the parity check must fail on it.
MOE_TORCH_PADDED_CASES = [torch_case("moe-padded-rows-full", arch="qwen3_moe", lora=False)]
# bf16 (model and router logits in bf16; the router sums in fp32), against the bf16 cp=1 reference within
# the reorder floor of the same run (check(bf16=True)).
MOE_BF16_CP2_CASES = [case("moe-packed-causal-full-bf16", arch="qwen3_moe", lora=False, bf16=True)]
# LoRA under autocast, as `cptune train` runs a bf16 recipe (the routers' adapters included): Qwen3-MoE's
# router takes its top-k from bf16 logits, Mixtral's too (issue 32).
MOE_BF16_CP2_CASES += [
    case("moe-packed-causal-lora-bf16-autocast", arch="qwen3_moe", bf16=True, autocast=True),
    case("mixtral-packed-causal-lora-bf16-autocast", arch="mixtral", bf16=True, autocast=True),
]
MOE_CP4_CASES = [
    case("moe-packed-causal-full", arch="qwen3_moe", lora=False, seq_len=30),
    case("mixtral-packed-causal-lora", arch="mixtral", seq_len=30),
]
MOE_DP2_CP2_CASES = [
    case("moe-unpacked-causal-full-23", arch="qwen3_moe", packed=False, lora=False, seq_len=23)
]
# quantize_moe_experts: QLoRA on a Qwen3-MoE whose expert tensors are packed in 4 bits too (every rank packs
# the same weights; the packed experts take no adapter), on the ring and with torch's CP attention.
MOE_PACKED_EXPERTS_CP2_CASES = [
    case("qlora-moe-packed-experts-packed-causal", arch="qwen3_moe", qlora=True, moe_experts=True),
    torch_case(
        "qlora-moe-packed-experts-full-rows", arch="qwen3_moe", full_rows=True, qlora=True, moe_experts=True
    ),
]


def pref_case(name: str, **changes) -> dict:
    return case(f"pref-{name}", **{"preference": "dpo", **changes})


# Preference training (tests/parallel/preference_case.py): DPO and IPO pairs, LoRA, ring-flash-attn's varlen_llama3;
# packed rows hold 2 pairs (4 documents), unpacked rows 1 pair. Metrics are checked too.
PREFERENCE_CP2_CASES = [
    pref_case("dpo-packed-mbs2-ga2", mbs=2, ga=2),
    pref_case("ipo-unpacked-mbs2", preference="ipo", packed=False, mbs=2),
    pref_case(
        "dpo-packed-dropout+head-loss", dropout=0.1, features={"head_loss": True, "head_loss_chunk": 97 * 5}
    ),
]
# Full fine-tunes (precompute_ref_log_probs): every model's reference sums computed before step 0 from its
# own weights (the CP model's through its backend), then no reference forward.
PREFERENCE_CP2_CASES += [
    pref_case("dpo-full-precomputed-packed-mbs2-ga2", lora=False, precompute=True, mbs=2, ga=2),
]
PREFERENCE_CP4_CASES = [
    pref_case("dpo-packed-mbs2", mbs=2),
    pref_case("ipo-full-precomputed-unpacked", preference="ipo", lora=False, precompute=True, packed=False),
]
PREFERENCE_DP2_CP2_CASES = [
    pref_case("dpo-packed-mbs2-ga2", mbs=2, ga=2),
    pref_case("dpo-full-precomputed-packed-ga2", lora=False, precompute=True, ga=2),
]
# tp=2 × cp=2 (FSDP2 over the cp ranks, full fine-tunes, as TP requires): the ranks of a tp group hold the same
# tokens, so each computes every pair's sums and counts the step's pairs; the losses, gradients and metrics must
# still be cp=1's. The DPO case's reference sums come from this test's with_reference: cptune's first pass
# (reference_pass) writes them once per tp rank, so the recipe refuses dpo/ipo with tensor parallelism for now.
TP2_PREFERENCE_CP2_CASES = [
    pref_case("tp2-dpo-full-precomputed-packed-mbs2-ga2", tp=2, lora=False, precompute=True, mbs=2, ga=2),
    pref_case("tp2-simpo-unpacked-full", preference="simpo", tp=2, lora=False, packed=False, mbs=2),
]
# The reference-free losses (no reference forward): per-token means, their target counts completed over the group.
PREFERENCE_CP2_CASES += [
    pref_case("simpo-packed-mbs2-ga2", preference="simpo", mbs=2, ga=2),
    pref_case("orpo-full-unpacked", preference="orpo", lora=False, packed=False),
]
PREFERENCE_CP4_CASES += [pref_case("orpo-packed-mbs2", preference="orpo", mbs=2)]
# dp2 x cp2 of the reference-free losses runs on the deepspeed backend (test_ulysses_parity.py), to keep this
# launch's time.


def torch_pref_case(name: str, **changes) -> dict:
    return pref_case(f"torch-{name}", backend="torch", packed=False, **changes)


# cp_backend: torch (no document mask): unpacked pairs, each side a row of its own followed by padding.
TORCH_PREFERENCE_CP2_CASES = [
    torch_pref_case("dpo-mbs2-ga2", mbs=2, ga=2),
    torch_pref_case("ipo-no-load-balance-alltoall", preference="ipo", load_balance=False, comm="alltoall"),
    torch_pref_case(
        "dpo-dropout+head-loss", dropout=0.1, features={"head_loss": True, "head_loss_chunk": 97 * 5}
    ),
]
TORCH_PREFERENCE_CP2_CASES += [
    torch_pref_case("dpo-full-precomputed-mbs2", lora=False, precompute=True, mbs=2)
]
TORCH_PREFERENCE_CP2_CASES += [torch_pref_case("orpo-mbs2", preference="orpo", mbs=2)]
TORCH_PREFERENCE_CP4_CASES = [torch_pref_case("dpo-mbs2", mbs=2)]
TORCH_PREFERENCE_DP2_CP2_CASES = [
    torch_pref_case("dpo-mbs2-ga2", mbs=2, ga=2),
    # The model states sharded by FSDP2 over all 4 ranks (dp_shard 2 × cp 2), LoRA's too: the reference forward
    # (the adapter disabled) gathers the same sharded layers as the policy's.
    torch_pref_case("dpo-fsdp2-mbs2", mbs=2, fsdp2=True),
]
# Bugs planted in the cross-rank sum of the pairs' log-probs (preference_case.PLANTED).
PREFERENCE_PLANTED_CASES = [
    pref_case("planted-pair-sum-local", inject="pair_sum_local", mbs=2),
    pref_case("planted-pair-sum-backward", inject="pair_sum_backward", mbs=2),
    pref_case("planted-torch-pair-sum-local", inject="pair_sum_local", backend="torch", packed=False, mbs=2),
    # SimPO's means dividing complete sums by this rank's share of each sequence's targets.
    pref_case("planted-pair-count-local", preference="simpo", inject="pair_count_local", mbs=2),
]

# Memory features (tests/parallel/case_features.py) on the CP model, off in the cp=1 reference. Each
# offload-only case repeats a case above with the same data and seeds: its CP run is compared with
# that case's bit for bit (FEATURE_TWINS).
ALL_FEATURES = {"offload": True, "tiles": 3, "norms": True, "head_loss": True}
FEATURE_CP2_CASES = [
    case("packed-causal-lora+offload", features={"offload": True}),
    case("packed-causal-full+offload", lora=False, features={"offload": True}),
    case("packed-causal-lora+offload-two-level", features={"offload": "two_level"}),
    case("packed-causal-lora+all-features", features=ALL_FEATURES),
    case("unpacked-causal-full+all-features", packed=False, lora=False, features=ALL_FEATURES),
    torch_case("causal-lora+offload", features={"offload": True}),
    torch_case("causal-full-alltoall+offload", lora=False, comm="alltoall", features={"offload": True}),
    torch_case("causal-lora+all-features", features=ALL_FEATURES),
    torch_case("causal-full-alltoall+all-features", lora=False, comm="alltoall", features=ALL_FEATURES),
]
# The same in bf16 as `cptune train` runs it (the base in bf16, LoRA in fp32, the forward under autocast),
# against the bf16 cp=1 reference without features: the tiled MLP's recomputation and the chunked loss
# must run under the forward's autocast (tests/models/test_memory_features_bf16.py at cp=1).
FEATURE_BF16_CP2_CASES = [
    case("packed-causal-lora+all-features-bf16", bf16=True, autocast=True, features=ALL_FEATURES),
]
FEATURE_TWINS = {
    c["name"]: c["name"].split("+")[0] for c in FEATURE_CP2_CASES if set(c["features"]) == {"offload"}
}

# spawn id -> (world size, cp size, cases of every backend run in that spawn)
SPAWNS = {
    "cp2-packed-experts": (2, 2, MOE_PACKED_EXPERTS_CP2_CASES),
    "cp2": (
        2,
        2,
        CP2_CASES
        + TORCH_CP2_CASES
        + FEATURE_CP2_CASES
        + FEATURE_BF16_CP2_CASES
        + ZIGZAG_CASES
        + PLANTED_CASES
        + PREFERENCE_CP2_CASES
        + TORCH_PREFERENCE_CP2_CASES
        + PREFERENCE_PLANTED_CASES
        + MOE_CP2_CASES
        + MOE_TORCH_CP2_CASES
        + MOE_TORCH_PADDED_CASES
        + MOE_BF16_CP2_CASES
        + WINDOW_CP2_CASES
        + ZIGZAG_WINDOW_CP2_CASES
        + ZIGZAG_WINDOW_BF16_CP2_CASES
        + ZIGZAG_WINDOW_PLANTED_CASES
        + SINK_CP2_CASES
        + SINK_ZIGZAG_CP2_CASES,
    ),
    "cp4": (
        4,
        4,
        CP4_CASES
        + TORCH_CP4_CASES
        + PREFERENCE_CP4_CASES
        + TORCH_PREFERENCE_CP4_CASES
        + MOE_CP4_CASES
        + WINDOW_CP4_CASES
        + ZIGZAG_WINDOW_CP4_CASES
        + ZIGZAG_WINDOW_BF16_CP4_CASES
        + SINK_CP4_CASES
        + SINK_ZIGZAG_CP4_CASES,
    ),
    "dp2xcp2": (
        4,
        2,
        DP2_CP2_CASES
        + TORCH_DP2_CP2_CASES
        + TP2_CP2_CASES
        + PREFERENCE_DP2_CP2_CASES
        + TORCH_PREFERENCE_DP2_CP2_CASES
        + TP2_PREFERENCE_CP2_CASES
        + MOE_DP2_CP2_CASES,
    ),
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
                    WORKER,
                    world,
                    tmp_path_factory.mktemp(spawn),
                    str(cp),
                    json.dumps(cases),
                    bitsandbytes=any(c.get("qlora") for c in cases),  # QLoRA cases quantize with it
                )
            except AssertionError as failure:  # reported by every test of the spawn, run once
                done[spawn] = failure
        if isinstance(done[spawn], AssertionError):
            raise done[spawn]
        return done[spawn]

    return results


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


#: How many times the largest distance of the reorder twins a bf16 CP run may land from the cp=1 reference
#: (``bf16_excesses``). Chosen from the chance of a false failure, not from one machine's distances: a CP run
#: that adds in orders as legal as the twins' lands beyond ``c`` times the largest of ``K`` independent draws
#: of the same noise with probability P(|X| > c·max(|Y_1|..|Y_K|)); for normal draws (Monte Carlo, 4·10^6
#: trials) K=1, c=2: 0.30 (the rule before: one eager twin, 2x); K=3, c=8: 0.0015; K=3, c=16: 0.0002. The
#: suite checks 2 quantities (losses, gradients) of 13 bf16 cases (7 in this module's cp2 launch, 1 in its cp4
#: launch, 5 in test_ulysses_parity.py's; a case's ranks report the same all-reduced values): 26 draws, so at
#: most about 26 × 0.0002 ≈ 0.5% of runs on another CPU fail at random. 16, not 8: a MoE model's bf16 routing flips a
#: token's experts now and then, a discrete jump that makes its noise heavier-tailed than a normal draw (over
#: seeds 11-18 a Qwen3-MoE LoRA case's CP losses landed 5.7x the farthest twin's, its gradients 4x); every
#: case of that sweep stays under 0.36 of this limit, the planted bf16 bug lands at least 5x past it
#: (issue 26).
BF16_FACTOR = 16.0


def bf16_excesses(r: dict) -> dict[str, float]:
    """One rank's bf16 results against the reorder floor: each quantity's distance over its limit (above 1 fails).

    Reorder floor: the case's cp=1 reference is computed again in the orders of
    tests/parallel/reorder_twins.py's ``TWINS`` (3 legal reorders of its attention sums) in the same
    run; the CP run may land at most :data:`BF16_FACTOR` times as far from the reference as the
    farthest twin does:

    - losses: the largest relative loss distance over the 3 SGD steps, against the twins' largest over
      their steps (each update feeds one order's rounding into the next step, the twins' and the CP
      run's alike, so both maxima grow together);
    - step-0 gradients: ``‖g_cp - g_ref‖ / ‖g_ref‖`` over every gradient together, against the same of
      each twin. A norm sums the errors of every element, so one draw varies little; the largest
      element's error of the largest tensor (``grad_rel``, reported) is an extreme of a few elements.
    """
    losses = max(rel(a, b) for a, b in zip(r["cp_losses"], r["ref_losses"], strict=True))
    twin_losses = max(
        rel(a, b) for twin in r["baseline_losses"] for a, b in zip(twin, r["ref_losses"], strict=True)
    )
    return {
        "losses": _over_floor(losses, twin_losses),
        "gradients": _over_floor(r["grad_norm_rel"], max(r["baseline_grad_norm_rel"])),
    }


def _over_floor(distance: float, floor: float) -> float:
    """``distance`` over :data:`BF16_FACTOR` times ``floor``; a zero floor (no twin moved) allows only 0."""
    if floor > 0:
        return distance / (BF16_FACTOR * floor)
    return 0.0 if distance == 0 else float("inf")


def check(results: list[dict], cases: list[dict], *, bf16: bool = False) -> None:
    """Every rank's losses (3 steps) and step-0 gradients of every case against the cp=1 reference.

    fp32: the float64-reference rule (tests/numerics.py, :func:`fp32_failures`). bf16 (``bf16``):
    the reorder floor of the same run (:func:`bf16_excesses`).
    """
    for name in (c["name"] for c in cases):
        for rank, per_rank in enumerate(results):
            r = per_rank[name]
            assert r["grad_nonzero"], f"{name}: reference gradients are zero, the check would be vacuous"
            if bf16:
                excesses = bf16_excesses(r)
                assert max(excesses.values()) <= 1, (name, rank, excesses, r["grad_rel"], r["grad_worst"])
            else:
                failures = fp32_failures(r)
                assert not failures, (name, rank, failures, r["grad_rel"], r["grad_worst"])
            # the run must actually train: the three losses are not all equal
            assert len(set(r["ref_losses"])) > 1


def fp32_excesses(r: dict) -> dict[str, float]:
    """One rank's fp32 results against the float64-reference rule: each quantity's distance over its limit.

    The reference's distance is the largest of the fp32 cp=1 reference's and its fp32 twins'
    (``fp32_twins``: the same reference in other legal orders, tests/parallel/reorder_twins.py). Each
    step's loss may land at most :data:`~tests.numerics.FP32_TWINS_FACTOR` (32) times as far from the
    float64 reference's as that, plus the bound of the step's sum of token losses reordered; each step-0
    gradient tensor (its max |error| over its max |float64 gradient|) as far, plus 2 ulps. Counted from the
    errors alone, the distinct values among a tensor's errors set its factor (:data:`~tests.numerics.TWINS_FACTORS`:
    161 for 2, 2.6e4 for 1); a loss takes the most distinct draws any gradient tensor shows (:func:`case_draws`),
    since its orders can round to one fp32 value (:func:`~tests.numerics.float64_scalar_twins_excess`).
    """
    twins = r["fp32_twins"]
    draws = case_draws(r)
    excesses = {}
    # A preference case reports its loss's floor (the reorder bound of the log-prob sums behind it).
    floors = r.get("loss_floors") or [loss_sum_floor(targets) for targets in r["targets"]]
    losses = zip(r["cp_losses"], r["ref_losses"], r["ref64_losses"], floors, strict=True)
    for step, (cp, ref, ref64, floor) in enumerate(losses):
        references = [rel(ref, ref64)] + [rel(t["losses"][step], ref64) for t in twins]
        excesses[f"loss at step {step}"] = float64_scalar_twins_excess(
            rel(cp, ref64), references, floor, draws
        )
    for tensor, error in r["ref_grad_errors"].items():
        references = [error] + [t["grad_errors"][tensor] for t in twins]
        excesses[f"gradient of {tensor}"] = float64_twins_excess(
            r["grad_errors"][tensor], references, ULP_FLOOR
        )
    return excesses


def case_draws(r: dict) -> int:
    """How many of one rank's fp32 reference and its twins are draws of their own: the most distinct values any
    step-0 gradient tensor's errors take among them (a twin that reorders nothing, as sdpa's math backend does not
    gpt-oss's eager attention, is the reference's draw again in every tensor)."""
    return max(
        distinct_draws([error] + [t["grad_errors"][tensor] for t in r["fp32_twins"]])
        for tensor, error in r["ref_grad_errors"].items()
    )


def fp32_failures(r: dict) -> dict[str, float]:
    """What of one rank's fp32 results breaks the float64-reference rule (:func:`fp32_excesses`), with how many
    times its limit."""
    return {what: excess for what, excess in fp32_excesses(r).items() if excess > 1}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"),
    [("cp2", CP2_CASES), ("cp4", CP4_CASES), ("dp2xcp2", DP2_CP2_CASES)],
    ids=["cp2", "cp4", "dp2xcp2"],
)
def test_varlen_llama3_parity_fp32(parity_results, spawn, cases):
    check(parity_results(spawn), cases)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"),
    [("cp2", TORCH_CP2_CASES), ("cp4", TORCH_CP4_CASES), ("dp2xcp2", TORCH_DP2_CP2_CASES)],
    ids=["cp2", "cp4", "dp2xcp2"],
)
def test_torch_parity_fp32(parity_results, spawn, cases):
    check(parity_results(spawn), cases)


@pytest.mark.distributed
def test_zigzag_parity_bf16(parity_results):
    results = parity_results("cp2")
    check(results, ZIGZAG_CASES, bf16=True)  # reorder floor: the same run's reorder twins


@pytest.mark.distributed
def test_memory_features_parity_cp2(parity_results):
    """Offloading, tiled MLP and the chunked head loss on at cp=2 (ring and torch), off at cp=1.

    Offloading changes no bit: each offload case's CP losses and step-0 gradients equal its twin's
    without offloading (two-level checkpointing too: layer 1's input made again from layer 0's). With every feature on, the fp32 parity check holds, and the bf16 one under
    autocast (the reorder floor of the same run's reorder twins).
    """
    results = parity_results("cp2")
    check(results, FEATURE_CP2_CASES)
    check(results, FEATURE_BF16_CP2_CASES, bf16=True)
    for per_rank in results:
        for name, twin in FEATURE_TWINS.items():
            assert per_rank[name]["cp_losses"] == per_rank[twin]["cp_losses"], (name, twin)
            assert per_rank[name]["grad_sha"] == per_rank[twin]["grad_sha"], (name, twin)


@pytest.mark.distributed
def test_tensor_parallel_tp2_cp2_parity_fp32(parity_results):
    """tp=2 × cp=2 (FSDP2 over the cp ranks) equals one process: losses of 3 SGD steps and step-0 gradients."""
    results = parity_results("dp2xcp2")
    for name in (c["name"] for c in TP2_CP2_CASES):
        losses = max(
            rel(a, b)
            for r in results
            for a, b in zip(r[name]["cp_losses"], r[name]["ref_losses"], strict=True)
        )
        print(f"{name}: losses {losses:.2g}, gradients {max(r[name]['grad_rel'] for r in results):.2g}")
    check(results, TP2_CP2_CASES)
    for per_rank in results:
        for name in (c["name"] for c in TP2_CP2_CASES):
            # FSDP2 shards dim 0 over dp_shard_cp; tp split q_proj's output and o_proj's input features.
            placements = per_rank[name]["placements"]
            assert placements["q_proj"][1] == "S(0)" and placements["o_proj"][1] == "S(1)", placements


def preference_metric_excesses(r: dict) -> dict[str, float]:
    """The step-0 preference metrics of one rank against the float64-reference rule, each one's distance over
    its limit (accuracy: equal, else infinitely far)."""
    excesses = {}
    cp, ref64 = r["cp_metrics"], r["ref64_metrics"]
    # The fp32 reference's metrics and its twins' (as fp32_excesses): the largest distance is the reference's.
    references = [r["ref_metrics"]] + [t["metrics"] for t in r["fp32_twins"]]
    for name, value in ref64.items():
        if name == "rewards/accuracies":
            excesses[name] = 0.0 if cp[name] == value else float("inf")
            continue
        errors = [rel(metrics[name], value) for metrics in references]
        excesses[name] = float64_scalar_twins_excess(
            rel(cp[name], value), errors, r["metric_floors"][name], case_draws(r)
        )
    return excesses


def preference_metric_failures(r: dict) -> dict[str, float]:
    """The step-0 preference metrics of one rank that break the float64-reference rule, with how many times
    their limit (:func:`preference_metric_excesses`)."""
    return {name: excess for name, excess in preference_metric_excesses(r).items() if excess > 1}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"),
    [
        ("cp2", PREFERENCE_CP2_CASES + TORCH_PREFERENCE_CP2_CASES),
        ("cp4", PREFERENCE_CP4_CASES + TORCH_PREFERENCE_CP4_CASES),
        ("dp2xcp2", PREFERENCE_DP2_CP2_CASES + TORCH_PREFERENCE_DP2_CP2_CASES + TP2_PREFERENCE_CP2_CASES),
    ],
    ids=["cp2", "cp4", "dp2xcp2"],
)
def test_preference_parity_fp32(parity_results, spawn, cases):
    """DPO/IPO/ORPO/SimPO pairs at cp=2, cp=4 and dp2 x cp2 (ring-flash-attn and torch, LoRA and full; torch also
    with the model states sharded by FSDP2): the losses of 3 SGD steps, the step-0 gradients and the step-0
    metrics (rewards/..., logps/..., and ORPO's and SimPO's nll_loss, log_odds_...) of the cp=1 run, by the
    float64 rule."""
    results = parity_results(spawn)
    check(results, cases)
    for name in (c["name"] for c in cases):
        for rank, per_rank in enumerate(results):
            failures = preference_metric_failures(per_rank[name])
            assert not failures, (name, rank, failures, per_rank[name]["cp_metrics"])
    for name in (c["name"] for c in cases if c.get("fsdp2")):  # FSDP2 really split every parameter
        for per_rank in results:
            assert per_rank[name]["whole_parameters"] == [], (name, per_rank[name]["whole_parameters"])


@pytest.mark.distributed
def test_planted_bugs_in_the_pair_sum_fail_the_fp32_parity_check(parity_results):
    """The pairs' log-prob sums left uncompleted across the CP ranks, completed in the forward only (the
    backward not summed over the group), and SimPO's target counts left uncompleted: the fp32 check fails on
    each."""
    results = parity_results("cp2")
    for case_ in PREFERENCE_PLANTED_CASES:
        failures = [fp32_failures(per_rank[case_["name"]]) for per_rank in results]
        worst = max((max(f.values()) for f in failures if f), default=0.0)
        print(f"{case_['name']}: {worst:.3g} times the limit")
        with pytest.raises(AssertionError):
            check(results, [case_])


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"),
    [
        ("cp2", MOE_CP2_CASES),
        ("cp2", MOE_TORCH_CP2_CASES),
        ("cp4", MOE_CP4_CASES),
        ("dp2xcp2", MOE_DP2_CP2_CASES),
    ],
    ids=["cp2", "torch-cp2", "cp4", "dp2xcp2"],
)
def test_moe_router_loss_parity_fp32(parity_results, spawn, cases):
    """A MoE model with its router loss at cp=2 and cp=4 (ring-flash-attn varlen_llama3), at cp=2 with the
    torch backend (Qwen3-MoE and Mixtral), and at cp=2 as 2
    data-parallel groups: the losses of 3 SGD steps and the step-0 gradients of the cp=1 run (router loss included), by the
    float64 rule; and the router loss logged each step (``router_aux_loss``) is the cp=1 run's."""
    results = parity_results(spawn)
    check(results, cases)
    for name in (c["name"] for c in cases):
        for rank, per_rank in enumerate(results):
            r = per_rank[name]
            # Against the float64 cp=1 value: fp32 rounding of sums over at most 4 rows x 24 tokens x 2 layers
            # (192 terms of magnitude <= 1, 192 x 2**-24 ~ 1.1e-5 each for the two per-expert sums and the
            # forward's own fp32 rounding before the router, the same bound again): 4e-5.
            errors = [rel(cp, ref) for cp, ref in zip(r["cp_router_aux"], r["ref64_router_aux"], strict=True)]
            assert max(errors) <= 4e-5, (name, rank, errors, r["cp_router_aux"])


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"), [("cp2", WINDOW_CP2_CASES), ("cp4", WINDOW_CP4_CASES)], ids=["cp2", "cp4"]
)
def test_sliding_window_parity_fp32(parity_results, spawn, cases):
    """Mistral (every layer windowed) and Gemma 3 (sliding, sliding, full) at cp=2 and cp=4 on ring-flash-attn's
    varlen_llama3: the losses of 3 SGD steps and the step-0 gradients of the cp=1 run, by the float64 rule."""
    check(parity_results(spawn), cases)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"),
    [("cp2", ZIGZAG_WINDOW_CP2_CASES), ("cp4", ZIGZAG_WINDOW_CP4_CASES)],
    ids=["cp2", "cp4"],
)
def test_zigzag_sliding_window_parity_fp32(parity_results, spawn, cases):
    """Mistral on the zigzag ring (batch_zigzag) at cp=2 and cp=4: every block's window in whole-row positions,
    the losses of 3 SGD steps and the step-0 gradients of the cp=1 run, by the float64 rule."""
    check(parity_results(spawn), cases)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"), [("cp2", SINK_CP2_CASES), ("cp4", SINK_CP4_CASES)], ids=["cp2", "cp4"]
)
def test_attention_sinks_parity_fp32(parity_results, spawn, cases):
    """gpt-oss (sinks on every layer, sliding and full layers) at cp=2 and cp=4 on ring-flash-attn's varlen_llama3,
    LoRA and full (the sinks train): the losses of 3 SGD steps and the step-0 gradients of the cp=1 run, by the
    float64 rule."""
    check(parity_results(spawn), cases)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"),
    [("cp2", SINK_ZIGZAG_CP2_CASES), ("cp4", SINK_ZIGZAG_CP4_CASES)],
    ids=["cp2", "cp4"],
)
def test_zigzag_attention_sinks_parity_fp32(parity_results, spawn, cases):
    """gpt-oss on the zigzag ring (batch_zigzag) at cp=2 (full fine-tune: the sinks train) and cp=4 (LoRA), the sink
    once onto each query's merged attention: the losses of 3 SGD steps and the step-0 gradients of the cp=1 run,
    by the float64 rule (the sink put into each block instead fails it: test_planted_bugs_fail_the_fp32_parity_check)."""
    check(parity_results(spawn), cases)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("spawn", "cases"),
    [("cp2", ZIGZAG_WINDOW_BF16_CP2_CASES), ("cp4", ZIGZAG_WINDOW_BF16_CP4_CASES)],
    ids=["cp2", "cp4"],
)
def test_zigzag_sliding_window_parity_bf16(parity_results, spawn, cases):
    """Gemma 3 (sliding, sliding, full) on the zigzag ring at cp=2 and cp=4 in bf16, within the reorder floor (the
    same run's reorder twins)."""
    check(parity_results(spawn), cases, bf16=True)


@pytest.mark.distributed
def test_a_zigzag_window_aligned_to_each_block_fails_the_bf16_check(parity_results):
    """The window handed to ring-flash-attn's zigzag function, aligned to each block (planted): the bf16 check of
    test_zigzag_sliding_window_parity_bf16 fails."""
    results = parity_results("cp2")
    for case_ in ZIGZAG_WINDOW_PLANTED_CASES:
        worst = max(max(bf16_excesses(per_rank[case_["name"]]).values()) for per_rank in results)
        print(f"{case_['name']}: {worst:.3g} times the limit")
        with pytest.raises(AssertionError):
            check(results, [case_], bf16=True)


@pytest.mark.distributed
def test_moe_router_loss_parity_bf16(parity_results):
    """A MoE model in bf16 at cp=2 (ring-flash-attn): losses and step-0 gradients within the reorder floor."""
    check(parity_results("cp2"), MOE_BF16_CP2_CASES, bf16=True)


@pytest.mark.distributed
def test_planted_bugs_fail_the_fp32_parity_check(parity_results):
    """A wrong gradient scale, a sliding window, a dropped document boundary, a per-rank router loss,
    Mistral's sliding windows counted in shard-local positions or dropped, and gpt-oss's sinks dropped or
    applied per block of keys (varlen_llama3's gathered blocks, the zigzag ring's), each planted in the cp=2 ring path: the fp32 check of the tests above fails
    on every one."""
    results = parity_results("cp2")
    for case_ in PLANTED_CASES:
        failures = [fp32_failures(per_rank[case_["name"]]) for per_rank in results]
        worst = max((max(f.values()) for f in failures if f), default=0.0)
        print(f"{case_['name']}: {worst:.3g} times the limit")
        with pytest.raises(AssertionError):
            check(results, [case_])


@pytest.mark.distributed
def test_a_router_loss_over_padding_the_torch_backend_lets_attend_fails_the_parity_check(parity_results):
    """Why cptune refuses a router loss with padded rows under cp_backend: torch (cptune.parallel.router_padding):
    the padding's routing, counted by the router loss, is not cp=1's, and the fp32 check fails."""
    results = parity_results("cp2")
    for case_ in MOE_TORCH_PADDED_CASES:
        with pytest.raises(AssertionError):
            check(results, [case_])


@pytest.mark.distributed
def test_packed_moe_experts_parity_fp32(parity_results):
    """quantize_moe_experts under context parallelism (ring-flash-attn varlen_llama3 and torch, cp=2): the
    losses of 3 SGD steps and the step-0 gradients of the cp=1 run of the same packed model, by the float64
    rule (the float64 reference reads the packed experts' dequantized values in float64)."""
    check(parity_results("cp2-packed-experts"), MOE_PACKED_EXPERTS_CP2_CASES)
