"""The benchmarks page's section on the memory model's coefficients: per-token bytes, the fit, predictions.

Rendered from docs/benchmarks/memory_traces.json (``python -m benchmarks.memory_coefficients trace``)
and the memory model as it stands; measures nothing.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks import memory_coefficients as mc

GiB = float(1 << 30)
# Check B (issue 27, docs/benchmarks/lease-2026-11-26-check-b): Llama-3.1-8B LoRA r=16, every memory
# feature on, cp=1, one H200 capped to 79.6 GiB, bf16 weights and fp32 LoRA without autocast.
CHECK_B = [(32_768, 22.2), (98_304, 36.3), (294_912, 77.5)]
CHECK_B_OUT_OF_MEMORY = 311_296
# The step as cptune's Trainer runs it (bf16 autocast, cptune's patches), every memory feature on, the
# same GPU and cap, cp=1 through transformers' sdpa (cuDNN's attention on Hopper); peaks in GiB
# (docs/benchmarks/gpu_results.json: the runs labelled "Trainer's path", commit b63ae62, and
# "recompute_norms", commit 4ba1921). 344,064 tokens trained; the lease's time capped the search there.
# trainer_two_level (issue 30's lease of 2026-11-27, commit ab21804): 8 of the 32 layers, so a step at
# 589,824 tokens fits a 10-minute call, within 69.4 GiB (79.6 less the 24 left-out layers' states); each
# peak here is the 8 layers' measured peak + those states (10.22 GiB, predict.lora_states), which the
# one-level norms run at 98,304 tokens bears out: 26.22 GiB so derived, 26.22 measured at 32 layers.
TRAINER_GPU = {
    "trainer": [(32_768, 20.48), (98_304, 31.09), (344_064, 69.71)],
    "trainer_norms": [(32_768, 19.17), (98_304, 26.22)],
    "trainer_two_level": [(32_768, 19.17), (98_304, 26.22), (524_288, 72.00), (589_824, 79.05)],
}
# The model against a GPU's peaks: never under, and at most this much over (issue 30's check of the refit).
GPU_GOAL = 0.15
# Before the lean loss phase (commit 2bd2c44, benchmarks/loss_phase.py, 4,096/8,192 tokens): the loss
# phase's peak per token at Llama-3.1-8B's widths before and after. The old path is gone, so it is cited.
LEAN_LOSS_PHASE = (88.0, 8.2)
ALST_CP8_TOKENS = 3_700_000


def eager_delta_per_token(traces: list[dict[str, Any]]) -> float:
    """What check B's setup (no autocast: an fp32 copy of every LoRA input) adds to the layer backward's
    peak per token at Llama-3.1-8B's widths, from the base shape's traces (x 8, see per_token_8b)."""
    eager = mc.slopes(traces, "lora-everything-eager", "base", 2)["backward"]
    autocast = mc.slopes(traces, "lora-everything", "base", 2)["backward"]
    return (eager - autocast) * 8


def check_b_rows(traces: list[dict[str, Any]]) -> list[tuple[int, float, float, float]]:
    """(tokens, measured GiB, the model for cptune's autocast run, the model for check B's eager run)."""
    from benchmarks.gpu import predict

    delta = eager_delta_per_token(traces)
    rows = []
    for tokens, measured in CHECK_B:
        model = predict.predict(predict.SETTINGS["everything"], tokens).peak_gib
        rows.append((tokens, measured, model, model + delta * tokens / GiB))
    return rows


def trainer_rows() -> list[tuple[str, int, float, float]]:
    """(setting, tokens, measured GiB, the model's GiB) for the GPU's runs on the Trainer's path."""
    from benchmarks.gpu import predict

    return [
        (setting, tokens, measured, predict.predict(predict.SETTINGS[setting], tokens).peak_gib)
        for setting, points in TRAINER_GPU.items()
        for tokens, measured in points
    ]


def fp32_tiled_note(traces: list[dict[str, Any]]) -> str:
    """Where fp32 LoRA with the tiled MLP is one moment in every shape, why not shorter, where it peaks."""
    lora = "fp32-lora-everything"
    short, long = mc.SETTINGS[lora].lengths
    before = mc.tiled_moments(traces, lora, (short // 2, short, long))
    where = sorted({m for phases in mc.peak_moments(traces, lora).values() for m in phases["backward"]})
    return (
        f"fp32 LoRA with the tiled MLP is one moment in every shape between {short:,} and {long:,} tokens: at "
        f"{short // 2:,} its "
        f"layer backward peaks higher in the base shape ({before['base'][0] / 1e6:.1f} MB) than in the MLP "
        f"shape ({before['mlp'][0] / 1e6:.1f} MB) and grows more slowly from there, two moments; at {short:,} "
        f"and {long:,} the two shapes' peaks are the same bytes ("
        + " and ".join(f"{before['base'][i] / 1e6:.1f} MB" for i in (1, 2))
        + "), and at both lengths each shape's trace names the same moment for every phase (the layer "
        "backward's: "
        + ", ".join(f"`{m}`" for m in where)
        + ", the autograd nodes being run, then the aten op that allocated). "
    )


def fp32_full_tiled_note(traces: list[dict[str, Any]]) -> str:
    """Where the fp32 full fine-tune with the tiled MLP is one moment in every shape, and why not shorter."""
    setting = "fp32-full-everything"
    short, long = mc.SETTINGS[setting].lengths
    before = mc.SETTINGS[setting].shorter[-1]
    at = {(t["shape"], t["tokens"]): t for t in traces if t["setting"] == setting and t["layers"] == 2}
    earlier = {shape: at[(shape, before)]["moments"]["backward"] for shape in mc.SHAPES}
    cat = at[("base", short)]["moments"]["backward"]

    def line(lengths: tuple[int, int]) -> tuple[float, float]:
        """The base shape's layer backward peak between two lengths: (bytes per token, bytes at no token)."""
        a, b = (at[("base", t)]["backward"] for t in lengths)
        slope = (b - a) / (lengths[1] - lengths[0])
        return slope, a - slope * lengths[0]

    (slope, fixed), (tile_slope, tile_fixed) = line((short, long)), line(mc.LONGEST_LENGTHS)
    crossing = (tile_fixed - fixed) / (slope - tile_slope)
    return (
        f"The fp32 full fine-tune with the tiled MLP is fitted between {short:,} and {long:,} tokens: there every "
        f"shape's layer backward peaks at `{cat}`, the concatenation of the tiles' outputs in the tiled MLP's "
        "forward, which gradient checkpointing runs again in the layer backward (base shape: "
        + " and ".join(f"{at[('base', t)]['backward'] / 1e6:,.1f} MB" for t in (short, long))
        + f", {slope:,.0f} bytes per token; the MLP shape at the same bytes), and each phase is one moment at both "
        f"lengths in every shape. Not shorter: at {before:,} the MLP shape already peaks there, the "
        + _series(s.replace("kv", "KV") for s in mc.SHAPES if s != "mlp" and earlier[s] != cat)
        + f" shapes still in a tile's backward (`{earlier['base']}`), whose fixed bytes keep it the higher: on the "
        f"base shape's lines (that moment's from {mc.LONGEST_LENGTHS[0]:,} and {mc.LONGEST_LENGTHS[1]:,} tokens, "
        f"{tile_slope:,.0f} bytes per token and {tile_fixed / 1e6:.1f} MB), below {crossing:,.0f} tokens."
    )


def _series(words: Any) -> str:
    """``a, b and c``."""
    words = list(words)
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else "".join(words)


def rotary_note(traces: list[dict[str, Any]]) -> str:
    """What the traces at head_dim 64 say of the rotary tables (every fitted row)."""
    narrow = mc.TRACED_SHAPES["head_dim"]
    differences = {setting: mc.rotary_differences(traces, setting) for setting in mc.FITTED_ROWS.values()}
    by_bytes = {
        b: sorted(
            {
                (d["forward"], d["loss"], d["backward"])
                for s, d in differences.items()
                if mc.rotary_bytes(s) == b
            }
        )
        for b in sorted({mc.rotary_bytes(s) for s in differences})
    }
    said = "; ".join(
        f"{'bf16' if b == 4 else 'fp32'}: " + ", ".join(f"{f:g}, {lo:g} and {bw:g}" for f, lo, bw in rows)
        for b, rows in by_bytes.items()
    )
    return (
        f"Checked on another shape, the base shape's hidden and KV widths at head_dim {narrow['head_dim']} "
        f"({narrow['num_attention_heads']} query heads, {narrow['num_key_value_heads']} KV heads), every fitted row "
        "at its lengths: per token the base shape's forward, loss and layer backward hold ("
        + said
        + " bytes) more, in every row: the tables' 2 x 64 x the dtype's bytes, exactly, and in the layer backward "
        "16 bytes fewer, the attention's fp32 log-sum-exp of the 4 more query heads (4 bytes per head and token; "
        "at head_dim 128 it is in the hidden term)"
    )


def render() -> list[str]:
    from benchmarks.gpu import predict

    data = json.loads(mc.TRACES.read_text())
    traces, about = data["traces"], data["about"]
    fitted = mc.fit(traces, data["attention_backward"])
    lines = [
        "### The memory model's coefficients, re-derived (benchmarks/memory_coefficients.py)",
        "",
        f"`{about['command']}` ({about['date']}; {about['versions']}) traces one step per case of Llama-3.1-8B at "
        "an eighth of its width (hidden 512 = 4 heads x 128, one KV head, MLP 1,792, vocabulary 2,048; three "
        "neighbouring shapes move the MLP, the KV heads and the hidden size one at a time), bf16 under autocast, "
        "LoRA r=16 on every linear layer in fp32, gradient checkpointing, the chunked head loss, at "
        f"{mc.LENGTHS[0]:,} and {mc.LENGTHS[1]:,} tokens; the same in fp32 (fp32 weights, no autocast), without "
        "gradient checkpointing, and with the loss from the model's fp32 logits, whole or in chunks of "
        f"{mc.CHUNK_TOKENS} tokens (a fifth shape doubles the vocabulary); with the tiled MLP, the full fine-tune at "
        f"{mc.LONG_LENGTHS[0]:,} and {mc.LONG_LENGTHS[1]:,} tokens, fp32 LoRA at {mc.LONGEST_LENGTHS[0]:,} and "
        f"{mc.LONGEST_LENGTHS[1]:,} and the fp32 full fine-tune at {mc.FP32_FULL_TILED_LENGTHS[0]:,} and "
        f"{mc.FP32_FULL_TILED_LENGTHS[1]:,}, each also at the shorter lengths that show why (below); "
        "`python -m benchmarks.memory_coefficients fit` turns the "
        "phase peaks into the coefficients `cptune.parallel.memory` reads (`cptune/parallel/memory_fit.py`; a test "
        "checks that the module is the fit of the committed traces). Raw numbers: "
        "[`benchmarks/memory_traces.json`](benchmarks/memory_traces.json).",
        "",
        "Per token at Llama-3.1-8B's widths (the base shape's slope x 8), 2 layers, KiB; *layer backward* is the "
        "step's peak with every feature on:",
        "",
        "| setup | forward | loss | layer backward |",
        "|---|---:|---:|---:|",
    ]
    named = [
        ("lora-peft", "gradient checkpointing + chunked loss, peft's LoRA input cast (before e5b9050)"),
        ("lora", "the same, LoRA input kept once (today)"),
        ("lora-everything-peft", "every feature, peft's LoRA input cast (before e5b9050)"),
        ("lora-everything", "every feature, LoRA input kept once (today)"),
        ("lora-everything-eager", "every feature, no autocast (check B's setup: fp32 LoRA input copies)"),
        ("lora-everything-norms", "every feature and recompute_norms"),
    ]
    for setting, label in named:
        kib = mc.per_token_8b(traces, setting)
        lines.append(f"| {label} | {kib['forward']} | {kib['loss']} | {kib['backward']} |")
    before, after = LEAN_LOSS_PHASE
    plain = mc.per_token_8b(traces, "lora-everything")["backward"]
    norms = mc.per_token_8b(traces, "lora-everything-norms")["backward"]
    lines += [
        "",
        f"Issue 30's target for the layer backward, 110 KiB per token or less, is met on these traces with "
        f"recompute_norms ({plain} -> {norms} with every feature); the GPU's attention backward keeps more "
        "(below).",
        "",
        f"The lean loss phase (2bd2c44) took the loss phase's own peak from {before} to {after} KiB per token at "
        "these widths (`python -m benchmarks.loss_phase`, measured then; the old path is gone, so every trace "
        "here has the lean one). The loss column above also holds the checkpoint rows and the last layer's "
        "output.",
        "",
        "Fitted, bytes per token as `h·hidden + i·intermediate + kv·kv_width + token + d·head_dim` (above the "
        "checkpoint rows; the layer backward also above the incoming gradient and the residual stream's, two "
        "hidden rows). `d` is stated, not fitted: the rotary tables, cos and sin of head_dim values per token in "
        "the compute dtype (4 bytes per unit of head_dim in bf16, 8 in fp32), held for the whole step; every "
        "fitting shape has head_dim 128, so the fit moves 128·d out of its constant. "
        + rotary_note(traces)
        + ":",
        "",
        "| precision, adapter, tiled MLP, recomputed norms | forward (h, i, kv, token, d) | loss | layer backward |",
        "|---|---|---|---|",
    ]
    for key, row in fitted["layers"].items():
        cells = " | ".join(", ".join(f"{x:g}" for x in row[phase]) for phase in mc.PHASES)
        lines.append(f"| {key.replace('/', ', ')} | {cells} |")
    lines += [
        "",
        "Without gradient checkpointing, what one layer keeps for its backward (the loss phase's slope without "
        "gradient checkpointing less the same step's with it, over the layers, plus the checkpointed row), "
        "and the loss from the model's fp32 logits above the checkpoints (fitted with mixed precision and LoRA; "
        "the model charges fp32 training the same; its logits are fp32 too, not traced so):",
        "",
        "| precision, adapter | saved per layer (h, i, kv, token, d) |",
        "|---|---|",
        *(
            f"| {key.replace('/', ', ')} | {', '.join(f'{x:g}' for x in row)} |"
            for key, row in fitted["saved"].items()
        ),
        "",
        "| loss from logits | (vocab, hidden, token, d) | at Llama-3.1-8B's widths, KiB per token |",
        "|---|---|---:|",
        *(
            f"| {mode} | {', '.join(f'{x:g}' for x in row)} | "
            f"{(row[0] * 128256 + row[1] * 4096 + row[2] + row[3] * 128) / 1024:.1f} |"
            for mode, row in fitted["logits_loss"].items()
        ),
        "",
        "One chunk in flight, per logit and per hidden unit of its tokens (what the loss phase's peak holds beyond "
        "its slope): "
        + "; ".join(f"{kind} {row[0]:g} and {row[1]:g}" for kind, row in fitted["chunk_bytes"].items())
        + " (the head loss recomputes a chunk's hidden states and logits in the backward; the chunked loss from "
        "logits a chunk's log-softmax).",
    ]
    rows = fitted["offload_rows_measured"]
    moments = mc.tiled_moments(traces)
    lines += [
        "",
        f"Activation offloading leaves **{fitted['offload_rows_on_device']} checkpoint rows** on the device "
        f"(measured: {rows['2']} at 2 layers, {rows['4']} at 4; the model charged 3 before this fit); without "
        "offloading one more layer adds "
        f"{fitted['checkpoint_row_bytes_per_token']['lora-tiled']:g} bytes per token to the layer backward "
        "(one bf16 row of hidden 512 is 1,024). The full fine-tune with the tiled MLP is fitted between "
        f"{mc.LONG_LENGTHS[0]:,} and {mc.LONG_LENGTHS[1]:,} tokens: at {mc.LENGTHS[0]:,} its layer backward's peak "
        "is, in the base shape, the moment the MLP's weight gradients are summed over the tiles (a size that does "
        f"not grow with the tokens): {moments['base'][0] / 1e6:.1f} MB against the MLP shape's "
        f"{moments['mlp'][0] / 1e6:.1f} MB, whose peak was the attention backward's; from {mc.LONG_LENGTHS[0]:,} on "
        "the attention backward's peak is above it in every shape (base and MLP shapes: "
        + ", ".join(f"{moments['base'][i] / 1e6:.1f} and {moments['mlp'][i] / 1e6:.1f} MB" for i in (1, 2))
        + " at "
        + " and ".join(f"{t:,}" for t in mc.LONG_LENGTHS)
        + " tokens). The model adds the summed weight gradients to that peak (an upper bound). "
        + fp32_tiled_note(traces)
        + "Its row is fitted there, since the rotary tables follow head_dim (above). "
        + fp32_full_tiled_note(traces),
        "",
        "Not in the traces, so listed with their source: FlashAttention-2's backward keeps an fp32 dQ accumulator "
        "and, with GQA, dK and dV expanded to every query head (32 KiB per token for Llama-3.1-8B in bf16; "
        "flash-attn's `mha_bwd` and torch's copy of it). torch's CPU attention backward, in the traces, holds "
        f"{fitted['cpu_attention_backward_rows']:g} expanded row at a time (measured, `attention_backward` in the "
        "file), so the model adds the other 24 KiB per token, and the KV heads' dK and dV that `mha_bwd` "
        "allocates before its kernel and sums the expanded ones into (4 KiB per token; the GPU showed them: "
        "without them the model was 1.9% under at 524,288 tokens), to the layer backward on a GPU "
        "(`memory.flash_backward_bytes`, 28 KiB per token), wherever in the layer the traced peak is: an upper "
        "bound. Also "
        "the CUDA context and allocator reserve, 2 GiB per GPU "
        "(`cptune.run.memory_plan.GPU_RESERVE`; check B saw 0.8 GiB outside torch's allocator, and needs "
        "`expandable_segments`).",
        "",
        "Against check B (issue 27; bf16 weights and fp32 LoRA without autocast, so every LoRA layer kept an fp32 "
        f"copy of its input: +{eager_delta_per_token(traces) / 1024:.1f} KiB per token by the traces). *Model* is "
        "cptune's run (autocast, the LoRA input patch); *model, check B's setup* adds what the traces say the "
        "eager run keeps more:",
        "",
        "| tokens | measured GiB | model GiB | model, check B's setup GiB | error (check B's setup) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for tokens, measured, model, eager in check_b_rows(traces):
        lines.append(f"| {tokens:,} | {measured} | {model:.1f} | {eager:.1f} | {eager / measured - 1:+.1%} |")
    lines += [
        "",
        "Against the GPU on the path cptune's Trainer runs (bf16 autocast, the LoRA input patch; every feature; "
        "one H200 capped to 79.6 GiB; cp=1 through transformers' sdpa, cuDNN's attention on Hopper; "
        "`gpu_results.json`). The goal: never under, at most "
        f"{GPU_GOAL:.0%} over. The FlashAttention-2 term is charged on every GPU path; with recompute_norms the "
        "attention backward sets the peak, and the GPU's slope, 112.7-114.0 KiB per token up to 589,824 tokens, "
        "is the model's (112.8) with the whole term; without recompute_norms the norms' temporaries set the peak "
        "and the GPU's slope is the traces', so there the term is the model's margin. The two_level rows ran "
        "Llama-3.1-8B's layers cut to 8 (a step at 589,824 tokens takes 267 s at 8 layers, about 18 minutes "
        "at 32, beyond a 10-minute call) within 69.4 GiB, and give the 8 layers' peak plus the 24 other "
        "layers' states (10.22 GiB); at 98,304 tokens that sum, 26.22 GiB, is what the 32 layers measured:",
        "",
        "| setting | tokens | measured GiB | model GiB | error |",
        "|---|---:|---:|---:|---:|",
    ]
    names = {
        "trainer": "every feature",
        "trainer_norms": "every feature + recompute_norms",
        "trainer_two_level": "every feature + recompute_norms, two_level (8 layers + states)",
    }
    for setting, tokens, measured, model in trainer_rows():
        lines.append(
            f"| {names[setting]} | {tokens:,} | {measured} | {model:.2f} | {model / measured - 1:+.1%} |"
        )
    everything = predict.SETTINGS["everything"]
    one = predict.longest(everything)
    qlora = predict.longest(everything, qlora=True)
    cp8 = predict.longest(everything, cp_size=8)
    cp8_fsdp = predict.longest(everything, cp_size=8, shard_ranks=8)
    lines += [
        "",
        f"Check B trained 294,912 tokens and ran out of memory at {CHECK_B_OUT_OF_MEMORY:,}.",
        "",
        "**Predictions, not measurements** (Llama-3.1-8B, LoRA r=16 on every linear layer, every memory feature "
        "on, H100 80GB, 2 GiB reserve; *host* is the pinned host memory of the offloaded checkpoints per GPU):",
        "",
        "| run | tokens per GPU | sequence | peak set by | host per GPU |",
        "|---|---:|---:|---|---:|",
        f"| LoRA, one H100 | {one.tokens_per_gpu:,} | **{one.tokens_per_gpu:,}** | {one.phase} | "
        f"{one.host_gib:.0f} GiB |",
        f"| QLoRA (NF4 base), one H100 | {qlora.tokens_per_gpu:,} | **{qlora.tokens_per_gpu:,}** | {qlora.phase} | "
        f"{qlora.host_gib:.0f} GiB |",
        f"| LoRA, 8x H100, cp=8, replicated | {cp8.tokens_per_gpu:,} | **{cp8.tokens_per_gpu * 8:,}** | "
        f"{cp8.phase} | {cp8.host_gib:.0f} GiB |",
        f"| LoRA, 8x H100, cp=8, FSDP2 over 8 | {cp8_fsdp.tokens_per_gpu:,} | **{cp8_fsdp.tokens_per_gpu * 8:,}** | "
        f"{cp8_fsdp.phase} | {cp8_fsdp.host_gib:.0f} GiB |",
        "",
        f"ALST reports {ALST_CP8_TOKENS / 1e6:.1f}M tokens on 8x H100 (measured; a full fine-tune with DeepSpeed "
        "Ulysses, weights and optimizer offloaded). cp=8 is ring-flash-attn (`varlen_llama3`), whose gathered "
        "K/V of the whole sequence the model counts. These are not bounded by host memory here: one GPU's pinned "
        "checkpoints fit check B's 128 GB host (125 GiB available), but at cp=8 a node needs 8 x the host "
        "column, which only a host of about 1 TB has.",
        "",
        *norms_predictions(),
    ]
    return lines


HOST_GIB = 128  # an H100 host's RAM as issue 30 states it


def norms_predictions() -> list[str]:
    """The page's predictions with recompute_norms: one H100 with a 128 GB host, and cp=8."""
    from benchmarks.gpu import predict

    norms = predict.SETTINGS["trainer_norms"]
    two_level = {**norms, "activation_offloading": "two_level"}
    host = HOST_GIB * GiB
    lines = [
        "**Predictions, not measurements**, with recompute_norms (every feature on, as above; one H100 80GB and a "
        f"host of {HOST_GIB} GiB, {predict.HOST_PINNABLE_FRACTION:.0%} of it pinnable, as `cptune validate "
        f"--host-memory {HOST_GIB}` plans; *pinned* is the layer inputs and, with `fsdp_config.offload_params`, "
        "the states FSDP2 keeps in host RAM):",
        "",
        "| run | offloading | tokens | limit (the other allows) | pinned host |",
        "|---|---|---:|---|---:|",
    ]
    # With fsdp_config.offload_params the states leave the GPU but take host RAM beside the layer inputs,
    # and cptune refuses two_level under FSDP2 (rules: its regenerating forward runs outside the layer's call).
    for label, qlora in (("LoRA", False), ("QLoRA (NF4 base)", True)):
        for offload_params in (False, True):
            run = f"{label}, one H100" + (", offload_params" if offload_params else "")
            for how, keys in (("plain", norms), ("two_level", two_level)):
                if offload_params and how == "two_level":
                    lines.append(f"| {run} | {how} | - | refused: two_level with FSDP2 is not built | - |")
                    continue
                got, pinned = predict.longest_on_host(keys, host, qlora=qlora, offload_params=offload_params)
                other = got.gpu_tokens if got.limit == "host RAM" else got.host_tokens
                lines.append(
                    f"| {run} | {how} | **{got.tokens:,}** | {got.limit} ({other:,}) | {pinned / GiB:.0f} GiB |"
                )
    best, pinned = predict.longest_on_host(two_level, host)
    plain_512k = 512 * 1024 * 32 * 4096 * 2 / GiB  # every layer's input, bf16, hidden 4,096
    lines += [
        "",
        f"Issue 30 asks for 512K tokens on one H100 with at most 100 GiB of pinned host memory: predicted with "
        f"two_level ({best.tokens:,} tokens, {best.limit} binds, {pinned / GiB:.0f} GiB pinned). With plain "
        f"offloading 512K would pin {plain_512k:.0f} GiB, more than 90% of the 128 GiB host: `cptune validate` "
        "refuses it before loading, naming the host RAM.",
    ]
    cp8 = predict.longest(norms, cp_size=8)
    cp8_fsdp = predict.longest(norms, cp_size=8, shard_ranks=8)
    lines += [
        "",
        f"At cp=8 on 8x H100 (ring-flash-attn, GPU memory only): **{cp8.tokens_per_gpu * 8:,}** tokens replicated, "
        f"**{cp8_fsdp.tokens_per_gpu * 8:,}** with FSDP2 over 8, beside ALST's {ALST_CP8_TOKENS / 1e6:.1f}M "
        f"(measured by ALST); their offloaded layer inputs need {cp8.host_gib:.0f} and {cp8_fsdp.host_gib:.0f} GiB "
        "of pinned host memory per GPU.",
    ]
    return lines
