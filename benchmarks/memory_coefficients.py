"""The activation memory model's coefficients, re-derived: trace an 8B-shaped scaled model, fit, write them.

``python -m benchmarks.memory_coefficients trace`` traces one training step per case (below, with
:mod:`benchmarks.memory_traces`) and writes the phase peaks to :data:`TRACES`
(docs/benchmarks/memory_traces.json; 174 traces; the newer ones also say where each phase peaked);
``python -m benchmarks.memory_coefficients fit`` fits the per-token coefficients from those traces and
writes :data:`FITTED` (``cptune/parallel/memory_fit.py``, which :mod:`cptune.parallel.memory` reads).
``fit --check`` only says whether the module is what the traces give (tests/benchmarks/
test_memory_coefficients.py runs the same comparison, so CI notices a hand edit or a stale module).

**The model traced.** Llama-3.1-8B at an eighth of its width: hidden 512 = 4 query heads x 128, one KV
head (GQA 4:1), MLP 3.5x (1,792), vocabulary 2,048, and three neighbours of that shape which move one
width at a time (MLP, KV heads, hidden), so that a layer's per-token bytes split into
``h·hidden + i·intermediate + kv·kv_width + token + d·head_dim`` (:class:`cptune.parallel.memory.Widths`;
``token`` holds what grows with no width: the labels, a loss's scalars). ``d`` is the rotary tables, cos and
sin of head_dim values per token in the compute dtype, held for the whole step: every shape above has
head_dim 128, so they are in the fitted constant, and the fit moves them to their own stated term
(:data:`ROTARY_TABLES`). Another shape, :data:`HEAD_DIM_SHAPE` (the base shape's hidden and KV widths at
head_dim 64), traced for every fitted row at its lengths, checks it: per token its forward and loss hold
exactly 2 x 64 x the dtype's bytes less than the base shape's, its layer backward that less 4 bytes per
more query head (the attention's fp32 log-sum-exp; at head_dim 128 in the hidden term). bf16
weights, the forward under bf16 autocast and the backward outside it (as accelerate runs bf16), LoRA
r=16 on every linear layer in fp32 (peft's default) with cptune's ``lora-input-kept-under-autocast``
patch (what ``cptune train`` applies), or a full fine-tune; gradient checkpointing; the chunked head
loss (``cut_cross_entropy``) in chunks of 512 tokens; with every memory feature, also with the decoder
layers' norms recomputed (``recompute_norms``, :mod:`cptune.models.recomputed_norms`).

**A trace.** One step after a warm-up step (the gradients exist), torch's CPU allocator events replayed
(:mod:`benchmarks.memtrace`), split into three phases by markers: *forward* (until the last layer's
forward returns), *loss* (until the first layer is recomputed in the backward) and *layer backward*
(the rest). Each phase's peak is counted above the bytes allocated when the step began.

**The fit.** Per case and shape, the slope of each phase's peak between two lengths (what a chunk,
a tile or a kernel's scratch weighs is the same at both). From the slopes, with ``b`` = 2 bytes (4 in fp32) and
``R`` checkpoint rows on the device (``layers``, or :data:`OFFLOAD_ROWS` measured with offloading):
layer backward = slope - (R + 2)·hidden·b (the incoming gradient and the residual stream's), forward =
slope - R·hidden·b, loss = slope - R·hidden·b; then the four widths solved from the four shapes. The checkpoint rows left on the device by offloading are measured on the base shape at 2
and 4 layers: the drop in the layer backward's slope against the same run without offloading.

**The other rows.** The fp32 rows the same way, from fp32 traces (rows of 4 bytes). What a layer keeps
without gradient checkpointing: the loss phase of a step without it less that of the same step with it
holds ``layers x (saved - row)``; solved from the four shapes. The loss from the model's fp32 logits
(accelerate's output conversion), whole or in chunks: the loss phase's slope above the checkpoint rows, as
``v·vocab + h·hidden + token`` from the base, hidden and vocabulary shapes. A chunk in flight: what the loss
phase's peak holds beyond its slope, per logit and per hidden unit of a chunk's tokens (base and hidden shapes).

**Lengths.** Each setting's slopes are taken between its two :attr:`Setting.lengths`: 2,048 and 4,096
tokens, except the full fine-tune with the tiled MLP, between 4,096 and 8,192: at 2,048 its base shape's
layer backward peaks where the MLP's weight gradients are summed over the tiles (a size that does not
grow with the tokens), its MLP shape's in the attention backward, so a slope across 2,048 mixes two
moments; from 4,096 on the attention backward's is the peak in every shape (:func:`tiled_moments`). fp32
LoRA with the tiled MLP between 8,192 and 16,384: below 8,192 its base shape's layer backward is above
the MLP shape's and grows more slowly (two moments); from 8,192 on both are the same bytes. The fp32 full
fine-tune with the tiled MLP between 32,768 and 65,536: below that no two lengths are one moment in every
shape (:data:`FITTED_ROWS`; each trace records where each phase peaked, :func:`peak_moments`). The shorter
lengths that show why are traced too (:attr:`Setting.shorter`). At each setting's two lengths a tile holds
the same tokens in every shape (``ceil(tokens / hidden)`` tiles: 512 tokens, or about 762 at hidden 768), so
what a tile holds cancels in the slope.

What the traces cannot show (GPU kernels' own buffers, the allocator's reserve) is listed in
:mod:`cptune.parallel.memory` with its source.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "docs" / "benchmarks" / "memory_traces.json"
FITTED = REPO / "src" / "cptune" / "parallel" / "memory_fit.py"

BASE = {"hidden_size": 512, "intermediate_size": 1792, "num_attention_heads": 4, "num_key_value_heads": 1}
SHAPES = {
    "base": BASE,
    "mlp": {**BASE, "intermediate_size": 1024},
    "kv": {**BASE, "num_key_value_heads": 2},
    "hidden": {**BASE, "hidden_size": 768, "num_attention_heads": 6},
}
HEAD_DIM, VOCAB, CHUNK_TOKENS, LORA_RANK = 128, 2048, 512, 16
# The rotary tables, cos and sin of head_dim values per token in the compute dtype, held for the whole step:
# not fitted (every traced shape but HEAD_DIM_SHAPE has head_dim 128) but stated, and checked against the
# traces at head_dim 64 (rotary_differences).
ROTARY_TABLES = 2
# From 2,048 tokens on, each phase's peak is the same moment at every length (the base shape with every
# feature on: the same slope between 2,048, 4,096 and 8,192 tokens, to the byte); at 1,024 an MLP tile
# still set it.
LENGTHS = (2048, 4096)
LONG_LENGTHS = (4096, 8192)
LONGEST_LENGTHS = (8192, 16384)
FP32_FULL_TILED_LENGTHS = (32768, 65536)
DTYPE_BYTES = 2
# The loss from logits is fitted against the vocabulary too: the base shape with twice its vocabulary.
LOSS_SHAPES = ("base", "hidden", "vocab")
# The rotary tables' share of the per-token constant: the base shape's hidden and KV widths at head_dim 64
# (8 query heads, 2 KV heads), traced for every fitted row at its lengths.
HEAD_DIM_SHAPE = {**BASE, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}
TRACED_SHAPES = {**SHAPES, "vocab": {**BASE, "vocab_size": 2 * VOCAB}, "head_dim": HEAD_DIM_SHAPE}


@dataclass(frozen=True)
class Setting:
    """How one traced step computes."""

    lora: bool
    offload: bool
    tiled: bool
    patched: bool = True  # cptune's lora-input-kept-under-autocast (LoRA only)
    autocast: bool = True  # False: bf16 weights, fp32 LoRA, no autocast (the GPU check B's setup)
    norms: bool = False  # recompute_norms: the decoder layers' RMSNorms keep their bf16 input only
    fp32: bool = False  # fp32 weights and compute, no autocast (the model's "fp32" rows)
    checkpointing: bool = True  # False: every layer keeps what its backward needs (the "saved" rows)
    loss: str = "head"  # "head": chunked head loss; "whole" / "chunked": from the model's fp32 logits
    lengths: tuple[int, int] = LENGTHS  # the two lengths its slopes are taken between
    # Shorter lengths also traced in every shape of SHAPES, not fitted: where the phases peak below ``lengths``,
    # the reason the slopes are taken there.
    shorter: tuple[int, ...] = ()

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.fp32 else DTYPE_BYTES


SETTINGS = {
    "lora": Setting(lora=True, offload=False, tiled=False),
    "lora-everything": Setting(lora=True, offload=True, tiled=True),
    "full": Setting(lora=False, offload=False, tiled=False),
    # For the checkpoint rows offloading leaves on the device: the same as lora-everything, not offloaded.
    "lora-tiled": Setting(lora=True, offload=False, tiled=True),
    # Before the LoRA input patch (peft's fp32 cast of every LoRA input), for the page's table.
    "lora-peft": Setting(lora=True, offload=False, tiled=False, patched=False),
    "lora-everything-peft": Setting(lora=True, offload=True, tiled=True, patched=False),
    # As the GPU's check B ran: no autocast, so every LoRA layer keeps an fp32 copy of its input.
    "lora-everything-eager": Setting(lora=True, offload=True, tiled=True, autocast=False),
    # Every feature and recompute_norms (cptune.models.recomputed_norms).
    "lora-everything-norms": Setting(lora=True, offload=True, tiled=True, norms=True),
    # The full fine-tune with the tiled MLP: from 4,096 tokens on its layer backward's peak is the attention
    # backward's in every shape; at 2,048 the base shape's was the MLP's weight gradients summed over the
    # tiles (a moment that does not grow with the tokens), the MLP shape's the attention's.
    "full-everything": Setting(lora=False, offload=True, tiled=True, lengths=LONG_LENGTHS, shorter=(2048,)),
    # fp32 training: fp32 weights, no autocast, LoRA in fp32.
    "fp32-lora": Setting(lora=True, offload=False, tiled=False, autocast=False, fp32=True),
    # fp32 LoRA with the tiled MLP: below 8,192 tokens the base shape's layer backward peaks at another moment
    # than the MLP shape's (FITTED_ROWS); from 8,192 on at the same bytes in both.
    "fp32-lora-everything": Setting(
        lora=True,
        offload=True,
        tiled=True,
        autocast=False,
        fp32=True,
        lengths=LONGEST_LENGTHS,
        shorter=LENGTHS,
    ),
    "fp32-full": Setting(lora=False, offload=False, tiled=False, autocast=False, fp32=True),
    # fp32 full fine-tune with the tiled MLP: one moment in every shape from 32,768 tokens on (FITTED_ROWS).
    "fp32-full-everything": Setting(
        lora=False,
        offload=True,
        tiled=True,
        autocast=False,
        fp32=True,
        lengths=FP32_FULL_TILED_LENGTHS,
        shorter=(*LENGTHS, *LONGEST_LENGTHS),
    ),
    # Without gradient checkpointing: what a layer keeps for its backward (against the same with it).
    "lora-saved": Setting(lora=True, offload=False, tiled=False, checkpointing=False),
    "full-saved": Setting(lora=False, offload=False, tiled=False, checkpointing=False),
    "fp32-lora-saved": Setting(
        lora=True, offload=False, tiled=False, autocast=False, fp32=True, checkpointing=False
    ),
    "fp32-full-saved": Setting(
        lora=False, offload=False, tiled=False, autocast=False, fp32=True, checkpointing=False
    ),
    # The loss from the model's logits (upcast to fp32 by accelerate's output conversion, as the Trainer
    # runs it), whole or in chunks of CHUNK_TOKENS x 2,048 logits.
    "lora-whole-logits": Setting(lora=True, offload=False, tiled=False, loss="whole"),
    "lora-chunked-logits": Setting(lora=True, offload=False, tiled=False, loss="chunked"),
}
# (setting, shapes, layers) traced at both LENGTHS.
CASES = [
    ("lora-everything", "base", 2),
    ("lora-tiled", "base", 2),
    ("lora-tiled", "base", 4),
    ("lora-everything", "base", 4),
    ("lora", "base", 2),
    ("lora-peft", "base", 2),
    ("lora-everything-peft", "base", 2),
    ("lora-everything-eager", "base", 2),
    *((name, shape, 2) for name in ("lora-everything", "lora") for shape in SHAPES if shape != "base"),
    *((name, shape, 2) for name in ("full", "full-everything") for shape in SHAPES),
    *(("lora-everything-norms", shape, 2) for shape in SHAPES),
    *((name, shape, 2) for name in ("lora-whole-logits", "lora-chunked-logits") for shape in LOSS_SHAPES),
    *(
        (name, shape, 2)
        for name in ("fp32-lora", "fp32-lora-everything", "fp32-full", "fp32-full-everything")
        for shape in SHAPES
    ),
    *(
        (name, shape, 2)
        for name in ("lora-saved", "full-saved", "fp32-lora-saved", "fp32-full-saved")
        for shape in SHAPES
    ),
    # Every fitted row at head_dim 64 (HEAD_DIM_SHAPE), at its lengths: the rotary tables' check.
    *(
        (name, "head_dim", 2)
        for name in (
            "lora",
            "fp32-lora",
            "full",
            "lora-everything",
            "fp32-full",
            "lora-everything-norms",
            "full-everything",
            "fp32-lora-everything",
            "fp32-full-everything",
        )
    ),
]
# The fitted rows: memory model key (precision, adapter, tiled MLP, recomputed norms) -> the setting traced.
FITTED_ROWS = {
    ("mixed", "lora", False, False): "lora",
    ("mixed", "lora", True, False): "lora-everything",
    ("mixed", "full", False, False): "full",
    ("mixed", "lora", True, True): "lora-everything-norms",
    ("mixed", "full", True, False): "full-everything",
    ("fp32", "lora", False, False): "fp32-lora",
    # One moment in every shape between 8,192 and 16,384 tokens (LONGEST_LENGTHS; below 8,192 the base shape's
    # layer backward is above the MLP shape's, 75.1 against 65.3 MB at 2,048 and 126.1 against 118.7 at 4,096,
    # and the same at 8,192, 237.3 MB). Adopted once the rotary tables followed head_dim (ROTARY_TABLES): with
    # them in the constant, at head_dim 128, tests/parallel/test_activation_memory.py's head_dim-16 check was
    # 32% over its trace.
    ("fp32", "lora", True, False): "fp32-lora-everything",
    ("fp32", "full", False, False): "fp32-full",
    # One moment in every shape between 32,768 and 65,536 tokens (FP32_FULL_TILED_LENGTHS): the layer backward's
    # peak is the `torch.cat` of the tiles' outputs in _TiledMlpFunction.forward, which gradient checkpointing
    # runs again in the layer backward to reach the MLP's saved input, at the same bytes in the base and MLP
    # shapes. Shorter, two moments (traced from 2,048 in every shape): the loss phase peaks in the loss's
    # log-softmax backward at 2,048 and 4,096 and in the last layer's MLP backward from 8,192 on (base shape);
    # the layer backward in a tile's backward up to 8,192 in every shape and at 16,384 in the base, KV and
    # hidden shapes, whose fixed bytes (the tile's intermediates, the MLP's summed weight gradients) keep that
    # moment the higher below about 23,700 tokens on the base shape's lines, while the MLP shape peaks at the
    # concatenation from 16,384. Writing the tiles into one output instead (tried) removes that moment, one fp32
    # row per token, but not the peak: 0.17 MB below it at 16,384 the post-attention RMSNorm's backward
    # (`MulBackward0 > aten::mul`, the norm weight's gradient terms for every token at once, which
    # cptune.models.recomputed_norms leaves as it is in fp32) grows as steeply.
    ("fp32", "full", True, False): "fp32-full-everything",
}
# What a layer keeps without gradient checkpointing: (precision, adapter) -> (the setting without it, with it).
SAVED_ROWS = {
    ("mixed", "lora"): ("lora-saved", "lora"),
    ("mixed", "full"): ("full-saved", "full"),
    ("fp32", "lora"): ("fp32-lora-saved", "fp32-lora"),
    ("fp32", "full"): ("fp32-full-saved", "fp32-full"),
}
# The loss from the model's logits, whole or in chunks -> the setting traced (mixed precision, LoRA).
LOGITS_ROWS = {"whole": "lora-whole-logits", "chunked": "lora-chunked-logits"}
PHASES = ("forward", "loss", "backward")


def planned_traces(cases: list[tuple[str, str, int]] = CASES) -> list[tuple[str, str, int, int]]:
    """Every trace the fit and its checks read, as (setting, shape, layers, tokens): each case at its setting's
    lengths, and a case of :data:`SHAPES` at 2 layers also at the setting's shorter lengths."""
    return [
        (name, shape, layers, tokens)
        for name, shape, layers in cases
        for tokens in (
            *(SETTINGS[name].shorter if shape in SHAPES and layers == 2 else ()),
            *SETTINGS[name].lengths,
        )
    ]


# --- the fit (pure arithmetic on the traces) ----------------------------------------------------


def attention_rows(peaks: dict[str, int]) -> float:
    """Query-width bf16 rows per token the CPU attention backward holds beyond the q, k, v gradients (base shape)."""
    query_row = BASE["num_attention_heads"] * HEAD_DIM * DTYPE_BYTES
    gradients = query_row + 2 * BASE["num_key_value_heads"] * HEAD_DIM * DTYPE_BYTES
    slope = (peaks[str(LENGTHS[1])] - peaks[str(LENGTHS[0])]) / (LENGTHS[1] - LENGTHS[0])
    return (slope - gradients) / query_row


def slopes(traces: list[dict[str, Any]], setting: str, shape: str, layers: int) -> dict[str, float]:
    """Bytes per token of each phase's peak between the two lengths."""
    short, long = (
        next(
            t
            for t in traces
            if (t["setting"], t["shape"], t["layers"], t["tokens"]) == (setting, shape, layers, tokens)
        )
        for tokens in SETTINGS[setting].lengths
    )
    span = long["tokens"] - short["tokens"]
    return {phase: (long[phase] - short[phase]) / span for phase in PHASES}


def widths_of(shape: dict[str, int]) -> tuple[int, int, int, int, int]:
    """A shape's (hidden, intermediate, kv_width, 1, head_dim): what :class:`Widths` multiplies."""
    head_dim = shape.get("head_dim", HEAD_DIM)
    return (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_key_value_heads"] * head_dim,
        1,
        head_dim,
    )


def rotary_bytes(setting: str) -> int:
    """Bytes per token per unit of head_dim of the rotary tables (cos and sin in the compute dtype)."""
    return ROTARY_TABLES * SETTINGS[setting].dtype_bytes


def with_rotary(coefficients: list[float], rotary: int) -> list[float]:
    """Coefficients fitted at head_dim 128 with the rotary tables' bytes moved from the constant to their own
    term: (..., token) -> (..., token - 128·rotary, rotary)."""
    *widths, token = coefficients
    return rounded([*widths, token - HEAD_DIM * rotary, rotary])


def rotary_differences(traces: list[dict[str, Any]], setting: str) -> dict[str, float]:
    """Per phase, the base shape's slope less that of :data:`HEAD_DIM_SHAPE` (the same hidden and KV widths at
    head_dim 64, twice the query heads): what head_dim 128 holds beyond head_dim 64 per token."""
    base, narrow = (slopes(traces, setting, shape, 2) for shape in ("base", "head_dim"))
    return {phase: base[phase] - narrow[phase] for phase in PHASES}


def least_squares(rows: list[tuple[int, ...]], values: list[float]) -> list[float]:
    """Coefficients c minimising sum((rows·c - values)^2), by the normal equations (exact in float64 here)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    y = [sum(r[i] * v for r, v in zip(rows, values, strict=True)) for i in range(n)]
    for col in range(n):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], y[col], y[pivot] = a[pivot], a[col], y[pivot], y[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * p for x, p in zip(a[r], a[col], strict=True)]
                y[r] -= f * y[col]
    return [y[i] / a[i][i] for i in range(n)]


def offload_rows(traces: list[dict[str, Any]], layers: int) -> float:
    """Checkpoint rows offloading leaves on the device: layers less the rows its backward no longer holds."""
    row = BASE["hidden_size"] * DTYPE_BYTES
    kept = slopes(traces, "lora-tiled", "base", layers)["backward"]
    offloaded = slopes(traces, "lora-everything", "base", layers)["backward"]
    return layers - (kept - offloaded) / row


def layer_terms(traces: list[dict[str, Any]], setting: str, shape: str, layers: int, rows: float) -> dict:
    """Per-token bytes of one layer's forward and backward and of the loss, above ``rows`` checkpoint rows."""
    s = slopes(traces, setting, shape, layers)
    row = SHAPES[shape]["hidden_size"] * SETTINGS[setting].dtype_bytes
    return {
        "forward": s["forward"] - rows * row,
        "loss": s["loss"] - rows * row,
        "backward": s["backward"] - (rows + 2) * row,
    }


def saved_terms(traces: list[dict[str, Any]], key: tuple[str, str], shape: str, layers: int = 2) -> float:
    """Per-token bytes one layer keeps without gradient checkpointing, from the loss phase of the same step
    with and without it: there every layer's saved tensors (or its checkpointed input) are held, beside the
    same loss, so ``layers x saved = layers x row + (without - with)``."""
    without, with_ = SAVED_ROWS[key]
    row = SHAPES[shape]["hidden_size"] * SETTINGS[with_].dtype_bytes
    kept = slopes(traces, without, shape, layers)["loss"] - slopes(traces, with_, shape, layers)["loss"]
    return row + kept / layers


def logits_widths(shape: str) -> tuple[int, int, int, int]:
    """A loss shape's (vocab, hidden, 1, head_dim): what the loss from logits multiplies."""
    traced = TRACED_SHAPES[shape]
    return (traced.get("vocab_size", VOCAB), traced["hidden_size"], 1, traced.get("head_dim", HEAD_DIM))


def logits_terms(traces: list[dict[str, Any]], setting: str, shape: str, layers: int = 2) -> float:
    """Per-token bytes of the loss from logits, above the checkpoint rows (one per layer)."""
    row = TRACED_SHAPES[shape]["hidden_size"] * SETTINGS[setting].dtype_bytes
    return slopes(traces, setting, shape, layers)["loss"] - layers * row


def chunk_bytes(traces: list[dict[str, Any]], setting: str) -> list[float]:
    """Bytes of the chunk in flight per logit and per hidden unit of a chunk's token, from what the loss
    phase's peak holds beyond its slope (the part that does not grow with the tokens) in the base and the
    hidden shapes: ``chunk tokens x (per_logit x vocab + per_hidden x hidden)``."""
    rows, values = [], []
    for shape in ("base", "hidden"):
        short = next(
            t
            for t in traces
            if (t["setting"], t["shape"], t["layers"], t["tokens"])
            == (setting, shape, 2, SETTINGS[setting].lengths[0])
        )
        constant = short["loss"] - slopes(traces, setting, shape, 2)["loss"] * short["tokens"]
        rows.append((CHUNK_TOKENS * VOCAB, CHUNK_TOKENS * SHAPES[shape]["hidden_size"]))
        values.append(constant)
    return least_squares(rows, values)


def tiled_moments(
    traces: list[dict[str, Any]],
    setting: str = "full-everything",
    tokens: tuple[int, ...] = (LENGTHS[0], *LONG_LENGTHS),
) -> dict[str, list[int]]:
    """A setting with the tiled MLP: the layer backward's peak of the base and MLP shapes at ``tokens``
    (the mixed full fine-tune's at 2,048, 4,096 and 8,192: the same peak in both shapes from 4,096 on, the
    MLP's size does not set it)."""
    return {
        shape: [
            next(
                t["backward"]
                for t in traces
                if (t["setting"], t["shape"], t["layers"], t["tokens"]) == (setting, shape, 2, length)
            )
            for length in tokens
        ]
        for shape in ("base", "mlp")
    }


def peak_moments(
    traces: list[dict[str, Any]], setting: str, lengths: tuple[int, ...] | None = None
) -> dict[str, dict[str, list[str | None]]]:
    """Where each shape's phases peaked at ``lengths`` (the setting's two by default; the trace's ``moments``, None
    in the traces recorded before they were kept): shape -> phase -> [one per length]. A slope is one moment's
    where both lengths name the same."""
    found = {
        (t["shape"], t["tokens"]): t.get("moments", {})
        for t in traces
        if t["setting"] == setting and t["layers"] == 2
    }
    return {
        shape: {
            phase: [found[(shape, tokens)].get(phase) for tokens in lengths or SETTINGS[setting].lengths]
            for phase in PHASES
        }
        for shape in SHAPES
    }


def fit(traces: list[dict[str, Any]], attention: dict[str, int]) -> dict[str, Any]:
    """Every coefficient the memory model reads, and the checks beside them (see the module docstring)."""
    measured_rows = {layers: offload_rows(traces, layers) for layers in (2, 4)}
    rows_on_device = round(measured_rows[4])
    per_layer = {  # what one more layer adds to the backward's slope without offloading: one checkpoint row
        "lora-tiled": (
            slopes(traces, "lora-tiled", "base", 4)["backward"]
            - slopes(traces, "lora-tiled", "base", 2)["backward"]
        )
        / 2
    }
    layers_fit: dict[str, Any] = {}
    # The settings traced in every shape at both their lengths (a row whose traces are missing is not fitted).
    have = {(t["setting"], t["shape"], t["layers"], t["tokens"]) for t in traces}
    traced = {
        name
        for name, setting in SETTINGS.items()
        if all(
            (name, shape, 2, tokens) in have
            for shape in (LOSS_SHAPES if setting.loss != "head" else SHAPES)
            for tokens in setting.lengths
        )
    }
    for key, setting in FITTED_ROWS.items():
        if setting not in traced:
            continue  # the memory model keeps its earlier row
        rows = rows_on_device if SETTINGS[setting].offload else 2
        terms = {shape: layer_terms(traces, setting, shape, 2, rows) for shape in SHAPES}
        design = [widths_of(SHAPES[shape])[:4] for shape in SHAPES]  # head_dim 128 in each: in the constant
        layers_fit["/".join(map(str, key))] = {
            phase: with_rotary(
                least_squares(design, [terms[shape][phase] for shape in SHAPES]), rotary_bytes(setting)
            )
            for phase in PHASES
        }
    saved_fit = {  # the rotary tables are held with and without gradient checkpointing: none in the difference
        "/".join(key): with_rotary(
            least_squares(
                [widths_of(SHAPES[shape])[:4] for shape in SHAPES],
                [saved_terms(traces, key, shape) for shape in SHAPES],
            ),
            0,
        )
        for key, (without, with_) in SAVED_ROWS.items()
        if {without, with_} <= traced
    }
    logits_fit = {
        mode: with_rotary(
            least_squares(
                [logits_widths(shape)[:3] for shape in LOSS_SHAPES],
                [logits_terms(traces, setting, shape) for shape in LOSS_SHAPES],
            ),
            rotary_bytes(setting),
        )
        for mode, setting in LOGITS_ROWS.items()
        if setting in traced
    }
    return {
        "cpu_attention_backward_rows": round(attention_rows(attention), 3),
        "offload_rows_on_device": rows_on_device,
        "offload_rows_measured": {str(k): round(v, 3) for k, v in measured_rows.items()},
        "checkpoint_row_bytes_per_token": {k: round(v, 1) for k, v in per_layer.items()},
        "layers": layers_fit,
        "saved": saved_fit,
        "logits_loss": logits_fit,
        "chunk_bytes": {
            kind: rounded(chunk_bytes(traces, setting))
            for kind, setting in (("head", "lora"), ("logits", LOGITS_ROWS["chunked"]))
            if setting in traced
        },
    }


def rounded(values: list[float]) -> list[float]:
    """Coefficients to 0.01 byte (+ 0.0: no -0.0 in the module or on the page)."""
    return [round(x, 2) + 0.0 for x in values]


def per_token_8b(traces: list[dict[str, Any]], setting: str) -> dict[str, float]:
    """The base shape's per-token phase peaks at 2 layers, x 8 for Llama-3.1-8B's widths (KiB per token).

    Every width of the base shape is an eighth of Llama-3.1-8B's (hidden, MLP, KV width), so x 8 scales
    every width term exactly; the per-token constants (rotary tables, labels) are overstated so.
    """
    return {phase: round(v * 8 / 1024, 1) for phase, v in slopes(traces, setting, "base", 2).items()}


def render_module(fitted: dict[str, Any], about: dict[str, Any]) -> str:
    """The text of :data:`FITTED`: the fit as Python literals, with where it comes from."""
    lines = [
        '"""The activation memory model\'s fitted coefficients. Generated: do not edit.',
        "",
        "Written by ``python -m benchmarks.memory_coefficients fit`` from the traces in",
        f"docs/benchmarks/memory_traces.json ({about['date']}; {about['versions']}).",
        "Each layer row is (h, i, kv, token, d): bytes per token per unit of hidden, intermediate and KV",
        "width, per token, and per unit of head_dim (the rotary tables; see cptune.parallel.memory.Widths).",
        '"""',
        "",
        f"OFFLOAD_ROWS_ON_DEVICE = {fitted['offload_rows_on_device']}",
        "# Query-width rows per token the CPU attention backward holds beyond the q, k, v gradients",
        f"CPU_ATTENTION_BACKWARD_ROWS = {fitted['cpu_attention_backward_rows']!r}",
        "# (precision, adapter, tiled MLP, recomputed norms) -> {phase: (h, i, kv, token, d)}",
        "LAYERS = {",
    ]
    for key, row in fitted["layers"].items():
        precision, adapter, tiled, norms = key.split("/")
        lines.append(f'    ("{precision}", "{adapter}", {tiled}, {norms}): {{')
        for phase in PHASES:
            values = ", ".join(repr(x) for x in row[phase])
            lines.append(f'        "{phase}": ({values}),')
        lines.append("    },")
    lines.append("}")
    lines += [
        "# Without gradient checkpointing, what one layer keeps for its backward:",
        "# (precision, adapter) -> (h, i, kv, token, d)",
        "SAVED = {",
        *(
            f'    ("{k.split("/")[0]}", "{k.split("/")[1]}"): ({", ".join(map(repr, v))}),'
            for k, v in fitted["saved"].items()
        ),
        "}",
        "# The loss from the model's fp32 logits, above the checkpoints: whole or chunked -> (vocab, hidden, token, d)",
        "LOGITS_LOSS = {",
        *(f'    "{k}": ({", ".join(map(repr, v))}),' for k, v in fitted["logits_loss"].items()),
        "}",
        "# One chunk in flight, of the head loss or of the loss from logits: (per logit, per hidden unit of its tokens)",
        "CHUNK_BYTES = {",
        *(f'    "{k}": ({", ".join(map(repr, v))}),' for k, v in fitted["chunk_bytes"].items()),
        "}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory_coefficients", description=__doc__.split("\n")[0]
    )
    parser.add_argument("action", choices=("trace", "fit"))
    parser.add_argument("--check", action="store_true", help="fit: only compare with the checked-in module")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, help="trace: only these settings' cases")
    parser.add_argument("--traces", type=Path, default=TRACES, help="trace: write here (to merge by hand)")
    args = parser.parse_args(argv)
    if args.action == "trace":
        from benchmarks.memory_traces import trace_all

        trace_all(args.traces, [case for case in CASES if not args.settings or case[0] in args.settings])
        return 0
    data = json.loads(TRACES.read_text())
    fitted = fit(data["traces"], data["attention_backward"])
    text = render_module(fitted, data["about"])
    if args.check:
        same = FITTED.exists() and FITTED.read_text() == text
        print(
            "memory_fit.py is what the traces give" if same else "memory_fit.py differs from the traces' fit"
        )
        return 0 if same else 1
    FITTED.write_text(text)
    print(json.dumps({k: v for k, v in fitted.items() if k != "layers"}, indent=1))
    for key, row in fitted["layers"].items():
        print(key, row)
    for setting in (
        "lora",
        "lora-peft",
        "lora-everything",
        "lora-everything-peft",
        "lora-everything-eager",
        "lora-everything-norms",
    ):
        print(f"{setting:>22} KiB/token at 8B widths:", per_token_8b(data["traces"], setting))
    return 0


if __name__ == "__main__":
    sys.exit(main())
