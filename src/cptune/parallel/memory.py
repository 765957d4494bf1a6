"""Per-rank memory of a training run, as pure arithmetic: model states and activations.

An estimate from parameter counts, shapes and dtypes, for ``cptune validate``: it
tells before launching whether a run fits, what sharding the states buys, and the
longest sequence that fits a GPU (:func:`activation_memory`, :func:`longest_tokens`;
checked against traces in tests/parallel/test_memory.py and against the H100 runs
on docs/benchmarks.md).

What each layout keeps per rank, for P parameters of which T are trained:

- plain DDP: everything whole, in the training dtype (bf16 training keeps bf16
  weights, gradients and optimizer state);
- FSDP2 over N ranks: everything divided by N; with bf16/fp16 the trained
  parameters are kept in fp32 (accelerate upcasts them; compute runs in half
  precision), frozen ones in the training dtype;
- DeepSpeed ZeRO over N ranks: stage 1 divides the optimizer state by N, stage 2
  also the gradients, stage 3 also the weights; half precision adds an fp32
  master copy of the trained parameters to the optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from cptune.parallel import memory_fit

FP32 = 4


@dataclass(frozen=True)
class StateMemory:
    """Bytes one rank holds for the model states on its GPU, and in host memory when they are offloaded."""

    weights: int
    gradients: int
    optimizer: int
    host: int = 0  # FSDP2's offloaded states (fsdp_config.offload_params); not on the GPU, not in total

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


@dataclass(frozen=True)
class OptimizerState:
    """The optimizer state of the trained parameters.

    Args:
        elements: Elements kept in the dtype of what the optimizer updates (the trained parameters,
            or DeepSpeed's fp32 master copy): AdamW's two moments are ``2 x`` the trained elements.
        low_bit_bytes: Bytes of 8-bit or 4-bit state, whose size does not depend on that dtype
            (an 8-bit optimizer keeps one byte per element under bf16 as under fp32).
    """

    elements: int
    low_bit_bytes: int = 0

    def nbytes(self, element_bytes: int) -> int:
        """Bytes of the state when full-precision elements take ``element_bytes`` each."""
        return self.elements * element_bytes + self.low_bit_bytes


def optimizer_state(optimizer: str, trainable_shapes: Sequence[tuple[int, ...]]) -> OptimizerState:
    """The optimizer state of the trained parameters of these shapes.

    AdamW keeps two moments per element; the Trainer's SGD has no momentum, so no
    state; Adafactor keeps one row and one column vector per matrix (factored
    second moment) and one vector per other parameter. Low-bit optimizers keep
    their moments in one byte (8-bit) or half a byte (4-bit) per element (their
    block-wise quantization constants, a few percent more, are left out).
    """
    numel = sum(_numel(shape) for shape in trainable_shapes)
    if optimizer == "adafactor":
        elements = sum(
            shape[-2] + shape[-1] if len(shape) >= 2 else _numel(shape) for shape in trainable_shapes
        )
        return OptimizerState(elements)
    if optimizer == "sgd":
        return OptimizerState(0)
    moments = {"ademamix": 3, "lion": 1, "adagrad": 1, "rmsprop": 1}
    count = next((n for family, n in moments.items() if family in optimizer), 2)
    if "8bit" in optimizer:
        return OptimizerState(0, low_bit_bytes=count * numel)
    if "4bit" in optimizer:
        return OptimizerState(0, low_bit_bytes=-(-count * numel // 2))
    if optimizer.startswith(("adamw", "paged_adamw", "ademamix", "paged_ademamix", "lion", "paged_lion")) or (
        optimizer in ("adagrad", "rmsprop", "rmsprop_bnb", "stable_adamw")
    ):
        return OptimizerState(count * numel)
    raise ValueError(f"no memory estimate for optimizer {optimizer!r}")


@dataclass(frozen=True)
class StateLayout:
    """How the model states are spread over the ranks.

    Args:
        sharding: ``"whole"`` (every rank holds them, plain DDP), ``"fsdp"`` (FSDP2) or
            ``"zero"`` (DeepSpeed ZeRO).
        ranks: Ranks the states are sharded over (1 for ``"whole"``).
        zero_stage: The ZeRO stage (0-3), for ``"zero"``.
        tp_size: Tensor-parallel ranks that split each weight before FSDP2 shards it (the estimate
            splits every weight so; those outside the model's TP plan, such as norms, are not).
    """

    sharding: Literal["whole", "fsdp", "zero"] = "whole"
    ranks: int = 1
    zero_stage: int = 0
    tp_size: int = 1
    offload: bool = False

    def describe(self) -> str:
        if self.sharding == "fsdp":
            where = ", offloaded to host RAM" if self.offload else ""
            rank_word = "rank" if self.ranks == 1 else "ranks"
            return (
                f"FSDP2 over {self.ranks} {rank_word}"
                + (f" × {self.tp_size} tp" if self.tp_size > 1 else "")
                + where
            )
        if self.sharding == "zero":
            return f"ZeRO-{self.zero_stage} over {self.ranks} ranks"
        return "every rank whole (plain DDP)"


def state_memory(
    *,
    total: int,
    trainable: int,
    optimizer: OptimizerState,
    dtype_bytes: int,
    layout: StateLayout,
    lora: bool = False,
    quantized: int = 0,
    quantized_bytes: float = 0.0,
    quantized_sharded: bool = True,
    in_flight: int = 0,
) -> StateMemory:
    """Per-rank bytes for weights, gradients and optimizer state: the one estimate cptune reports.

    Args:
        total: All parameters.
        trainable: Trained parameters.
        optimizer: Their optimizer state (:func:`optimizer_state`).
        dtype_bytes: Bytes per element of the training dtype (2 for bf16/fp16, 4 for fp32).
        layout: How the states are spread over the ranks.
        lora: The trained parameters are a LoRA adapter: peft keeps it in fp32 whatever the base
            model's dtype (``autocast_adapter_dtype``), so without sharding its gradients and
            optimizer state are fp32 too.
        quantized: Base weights stored quantized (bitsandbytes) instead of in the training dtype.
        quantized_bytes: Bytes per quantized weight (:func:`quantized_bytes_per_weight`).
        quantized_sharded: Under FSDP2, the quantized weights are sharded like the others (4-bit weights
            stored in a float dtype, cptune's default); false when they are stored in uint8, which
            accelerate leaves out of FSDP2 (every rank holds them whole).
        in_flight: With ``layout.offload``, the bytes of the whole (gathered) weights the GPU holds
            while layers run (:func:`gathered_in_flight`): FSDP2's root module (embeddings, final
            norm, output head), which stays gathered from the forward to the backward, and two
            decoder layers (the one running and the one prefetched).
    """
    if layout.offload:
        sharded = state_memory(
            total=total, trainable=trainable, optimizer=optimizer, dtype_bytes=dtype_bytes,
            layout=replace(layout, offload=False), lora=lora, quantized=quantized,
            quantized_bytes=quantized_bytes, quantized_sharded=quantized_sharded,
        )  # fmt: skip
        return StateMemory(weights=in_flight, gradients=0, optimizer=0, host=sharded.total)
    common = {"total": total, "trainable": trainable, "optimizer": optimizer, "dtype_bytes": dtype_bytes}
    if layout.sharding == "fsdp" and quantized and not quantized_sharded:
        # accelerate keeps 4-bit weights stored in uint8 out of FSDP2 (ignored_params): each rank holds them whole.
        common["total"] = total - quantized
        memory = fsdp_state_memory(**common, shard_ranks=layout.ranks)
        return replace(memory, weights=memory.weights + math.ceil(quantized * quantized_bytes))
    if layout.sharding == "fsdp":
        memory = fsdp_state_memory(**common, shard_ranks=layout.ranks * layout.tp_size)
        weight_ranks = layout.ranks * layout.tp_size
    elif layout.sharding == "zero":
        memory = zero_state_memory(**common, stage=layout.zero_stage, ranks=layout.ranks)
        weight_ranks = layout.ranks if layout.zero_stage >= 3 else 1
    else:
        memory = fsdp_state_memory(**common, shard_ranks=1, trained_bytes=FP32 if lora else None)
        weight_ranks = 1
    if quantized:
        saved = quantized * dtype_bytes - math.ceil(quantized * quantized_bytes)
        memory = replace(memory, weights=memory.weights - saved // weight_ranks)
    return memory


def gathered_in_flight(total: int, all_layers: int, largest_layer: int, dtype_bytes: int) -> int:
    """Bytes of whole weights on a GPU while FSDP2 runs: its root module's and two decoder layers'.

    ``total`` parameters, of which ``all_layers`` in the decoder layers (each its own FSDP2 unit);
    the rest (embeddings, final norm, output head) belongs to the root unit, which FSDP2 keeps
    gathered between the forward and the backward. Gathered weights are in the training dtype.
    """
    return ((total - all_layers) + 2 * largest_layer) * dtype_bytes


def fsdp_state_memory(
    *,
    total: int,
    trainable: int,
    optimizer: OptimizerState,
    dtype_bytes: int,
    shard_ranks: int,
    trained_bytes: int | None = None,
) -> StateMemory:
    """Per-rank bytes under FSDP2 over ``shard_ranks`` ranks (1: plain DDP).

    The other arguments are those of :func:`state_memory`; ``trained_bytes`` is the bytes per
    trained element when known (peft keeps LoRA adapters in fp32).
    """
    # accelerate keeps fp32 master weights for trained parameters when sharding with mixed precision;
    # under DDP cptune trains in the dtype it loaded.
    if trained_bytes is None:
        trained_bytes = FP32 if shard_ranks > 1 else dtype_bytes
    weights = (total - trainable) * dtype_bytes + trainable * trained_bytes
    return StateMemory(
        weights=_ceil_div(weights, shard_ranks),
        gradients=_ceil_div(trainable * trained_bytes, shard_ranks),
        optimizer=_ceil_div(optimizer.nbytes(trained_bytes), shard_ranks),
    )


def zero_state_memory(
    *,
    total: int,
    trainable: int,
    optimizer: OptimizerState,
    dtype_bytes: int,
    stage: int,
    ranks: int,
) -> StateMemory:
    """Per-rank bytes under DeepSpeed ZeRO ``stage`` (0-3) over ``ranks`` ranks; see :func:`state_memory`."""
    master = trainable * FP32 if dtype_bytes < FP32 else 0
    return StateMemory(
        weights=_ceil_div(total * dtype_bytes, ranks if stage >= 3 else 1),
        gradients=_ceil_div(trainable * dtype_bytes, ranks if stage >= 2 else 1),
        optimizer=_ceil_div(optimizer.nbytes(FP32) + master, ranks if stage >= 1 else 1),
    )


def quantized_bytes_per_weight(bits: int, double_quant: bool = True) -> float:
    """Bytes per weight of a bitsandbytes-quantized linear layer, its quantization constants included.

    4-bit (NF4/FP4): half a byte, plus one fp32 scale per block of 64 weights (1/16 byte), which
    double quantization stores in 8 bits with fp32 scales per 256 blocks (about 1/63 byte). 8-bit
    (LLM.int8()): one byte (its per-row scales are left out).
    """
    if bits == 8:
        return 1.0
    return 0.5 + ((1 + 4 / 256) / 64 if double_quant else 4 / 64)


def format_bytes(count: float) -> str:
    """``1536`` → ``1.5 KiB``; binary units, three significant figures."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{value:.0f} B"
            # Three significant figures, without an exponent: a value that rounds to 1000 or more
            # (999.7 as well as 1000 to 1023 of a unit) is printed whole.
            text = f"{value:.3g}"
            return f"{text} {unit}" if "e" not in text else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- activations -------------------------------------------------------------------------------
#
# Per-token bytes of one decoder layer, as ``h·hidden + i·intermediate + kv·(KV heads x head dim) + token
# + d·head_dim`` (d: the rotary tables) for Llama-style layers (RMSNorm, GQA attention, SwiGLU MLP). "mixed" is bf16/fp16 training as the
# Trainer runs it: weights in half precision, the forward under autocast, LoRA adapters in fp32
# (peft's default) with cptune's lora-input-kept-under-autocast patch; "fp32" is everything in fp32.
#
# The rows are fitted by ``python -m benchmarks.memory_coefficients fit`` from CPU traces of an 8B-shaped
# scaled model (hidden 512 = 4 heads x 128, one KV head, MLP 3.5x, and three neighbouring shapes; a fourth
# with twice the vocabulary for the loss from logits) kept in docs/benchmarks/memory_traces.json: the
# layers with gradient checkpointing and their head loss, what a layer keeps without it, the loss from
# whole or chunked logits, a chunk in flight and the checkpoint rows offloading leaves on the device.
# Every shape but one has head_dim 128; the rotary tables' bytes (cos and sin, head_dim values each per
# token in the compute dtype) are a stated term, checked against another shape at head_dim 64.
# They live in cptune.parallel.memory_fit. What the traces cannot show is listed below (GPU-only terms).


@dataclass(frozen=True)
class Widths:
    """Bytes per token as ``h·hidden + i·intermediate + kv·kv_width + token + d·head_dim``.

    ``d`` is the rotary tables, cos and sin of ``head_dim`` values per token in the compute dtype, held for the
    whole step (2 x its bytes; not fitted: the traces at head_dim 64 and 128 differ by exactly that,
    benchmarks/memory_coefficients.py); ``token`` is what grows with no width (the labels, a loss's scalars).
    """

    h: float
    i: float = 0.0
    kv: float = 0.0
    token: float = 0.0
    d: float = 0.0

    def per_token(self, shape: ModelShape) -> float:
        return (
            self.h * shape.hidden
            + self.i * shape.intermediate
            + self.kv * shape.kv_width
            + self.token
            + self.d * shape.head_dim
        )


@dataclass(frozen=True)
class LayerBytes:
    """One layer's per-token bytes: its backward with recomputation, its forward, what it saves without it,
    and the head loss above the checkpoints."""

    backward: Widths
    forward: Widths
    saved: Widths | None  # kept per layer without gradient checkpointing (None: tiled, the untiled row's)
    head_loss: Widths


def _fitted(key: tuple[str, str, bool], norms: bool = False) -> LayerBytes:
    """The fitted row of ``key`` (with the norms recomputed if ``norms``), untiled rows with what a layer keeps
    without gradient checkpointing."""
    row = memory_fit.LAYERS[(*key, norms)]
    saved = None if key[2] else Widths(*memory_fit.SAVED[key[:2]])
    return LayerBytes(Widths(*row["backward"]), Widths(*row["forward"]), saved, Widths(*row["loss"]))


# (precision, adapter, tiled MLP) -> coefficients, every one fitted.
LAYER_BYTES: dict[tuple[str, str, bool], LayerBytes] = {
    (precision, adapter, tiled): _fitted((precision, adapter, tiled))
    for precision in ("mixed", "fp32")
    for adapter in ("lora", "full")
    for tiled in (False, True)
}
# The same with the decoder layers' norms recomputed (recompute_norms), where fitted. Elsewhere the model
# keeps the row above: recomputing the norms only drops what they save (their fp32 input copies), so
# that row is an upper bound.
RECOMPUTED_NORMS_LAYER_BYTES: dict[tuple[str, str, bool], LayerBytes] = {
    key[:3]: _fitted(key[:3], norms=True) for key in memory_fit.LAYERS if key[3]
}
# Checkpointed layer inputs that activation offloading leaves on the device (fitted: the one being
# recomputed and the one prefetched).
OFFLOAD_ROWS_ON_DEVICE = memory_fit.OFFLOAD_ROWS_ON_DEVICE
# The loss from the model's logits, per token above the checkpoints: (vocab, hidden, token, head_dim) bytes, whole or
# in chunks of LOSS_CHUNK_ELEMENTS (fitted with mixed precision, where accelerate upcasts the model's outputs;
# charged to fp32 training too, whose logits are fp32 as well: not traced in fp32).
LOGITS_LOSS_BYTES = memory_fit.LOGITS_LOSS
# One chunk of logits in flight, per logit and per hidden unit of a chunk's token (fitted): the chunked
# loss from logits recomputes a chunk's log-softmax in the backward; the head loss (cut_cross_entropy) also
# a chunk's hidden states and logits.
CHUNK_BYTES = memory_fit.CHUNK_BYTES

# GPU-only terms: what CPU traces cannot show, each with its source.
#
# - FlashAttention-2's backward (flash-attn's mha_bwd, and torch's copy of it behind SDPA's flash
#   backend) accumulates dQ in fp32 (heads x head_dim x 4 bytes per token) and, with GQA, writes dK
#   and dV for every query head before summing them per KV head (2 x heads x head_dim in the compute
#   dtype): 32 KiB per token for Llama-3.1-8B in bf16, as issue 30 lists them. torch's CPU attention
#   backward, which the traces hold, keeps one such expanded gradient at a time (measured:
#   memory_fit.CPU_ATTENTION_BACKWARD_ROWS), so the model adds the difference, 24 KiB per token for
#   Llama-3.1-8B. The sum goes into dK and dV of the KV heads, which mha_bwd allocates before the
#   kernel runs (``dk = empty_like(k)``), so they are held beside the expanded ones: 2 x kv_heads x
#   head_dim more, 4 KiB per token for Llama-3.1-8B, 28 in all. The model adds the term to the layer
#   backward's peak, wherever in the layer that peak is: an upper bound.
#   Measured on GPUs (docs/benchmarks/gpu_results.json):
#   - check B (issue 27: 77.5 GiB at 294,912 tokens, without autocast): the model for that setup is over.
#   - the Trainer's path (bf16 autocast; transformers' sdpa, which runs cuDNN's attention on Hopper):
#     without recompute_norms the norms' fp32 temporaries set the layer's peak, away from the attention's
#     buffers, and the GPU's slope (165-170 KiB/token) is the trace's (169.3): the term is what makes the
#     model 8-14% over there. With recompute_norms the attention backward sets the peak: the GPU's slope
#     is 112.7-114.0 KiB/token from 32K to 589,824 tokens (two_level; 8 of the 32 layers for the long
#     steps, issue 30's lease of 2026-11-27), 4 KiB/token above the model's (108.8) with only the first
#     24 KiB: without the KV heads' dK/dV the model was 1.9% and 2.1% under at 524,288 and 589,824 tokens.
#   cptune's own cp=1 path for full-attention models (document attention) and ring-flash-attn run
#   FlashAttention-2 (torch's copy), the kernel the term is read from.
# - The allocator's reserve and the CUDA context: cptune.run.memory_plan.GPU_RESERVE (2 GiB); check B
#   measured 0.8 GiB outside torch's allocator at its out-of-memory error, and trained 294,912 tokens
#   at 77.5 GiB allocated of 79.6 with expandable segments (the default allocator lost ~10 GiB).
FLASH_DQ_ACCUMULATOR_BYTES = FP32


def flash_backward_bytes(shape: ModelShape, dtype_bytes: int) -> float:
    """Per-token bytes FlashAttention-2's backward holds on a GPU beyond what the CPU traces hold: the fp32
    dQ accumulator and, when the model has fewer KV heads (GQA), dK/dV expanded to every query head (less
    the expanded rows torch's CPU kernel holds) beside the KV heads' dK/dV they are summed into."""
    query_row = shape.heads * shape.head_dim * dtype_bytes
    accumulator = FLASH_DQ_ACCUMULATOR_BYTES * shape.heads * shape.head_dim
    if shape.kv_heads >= shape.heads:
        return accumulator
    expanded = (2 - memory_fit.CPU_ATTENTION_BACKWARD_ROWS) * query_row
    return accumulator + expanded + 2 * shape.kv_width * dtype_bytes


@dataclass(frozen=True)
class ModelShape:
    """What the activation estimate needs to know about a decoder-only model."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class ActivationSetup:
    """How a run computes: precision, adapter, memory features and context parallelism.

    Attributes:
        mixed_precision: bf16/fp16 training (half-precision activations, autocast); else fp32.
        lora: LoRA adapter (the output layer frozen); else a full fine-tune.
        offload: The checkpointed layer inputs are kept in host memory (activation offloading).
        two_level: Only every second layer's input is offloaded, the others regenerated in the backward
            (two-level checkpointing, :func:`offloaded_layers`).
        tiled_mlp: The MLP runs over tiles of ``tiled_mlp_num_shards`` (default ceil(tokens / hidden)).
        recompute_norms: The decoder layers' norms keep their input and recompute in the backward
            (:data:`RECOMPUTED_NORMS_LAYER_BYTES`).
        attention_buffers: The CP backend's K/V buffers: per-token bytes in one layer's forward, given
            the model's shape, ``cp_size`` and the dtype's bytes (a backend's ``attention_buffer_bytes``
            bound to its recipe); ``None`` at cp=1.
        reference_forward: Preference training against the base model with the adapter disabled (``rl`` with
            LoRA, no ``precompute_ref_log_probs``): each micro batch first runs that reference forward over the
            same tokens, without gradients (:func:`no_grad_forward_memory`, the phase ``"reference forward"``).
        flash_attention: The run is on a GPU, whose attention backward holds FlashAttention-2's buffers
            (:func:`flash_backward_bytes`); False for the CPU traces the coefficients are checked against.
            Every GPU path is charged them: ring-flash-attn and cptune's cp=1 document attention run
            FlashAttention-2 (torch's copy); transformers' sdpa runs cuDNN's attention on Hopper, whose
            backward measured as much where it sets the peak (see the GPU-only terms below).
    """

    mixed_precision: bool
    lora: bool
    gradient_checkpointing: bool = True
    offload: bool = False
    two_level: bool = False
    tiled_mlp: bool = False
    tiled_mlp_num_shards: int | None = None
    recompute_norms: bool = False
    head_loss: bool = False
    loss_chunk_elements: int = 1 << 26
    cp_size: int = 1
    attention_buffers: Callable[[ModelShape, int, int], float] | None = None
    reference_forward: bool = False
    flash_attention: bool = True

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.mixed_precision else FP32

    def tile_tokens(self, tokens: int, hidden: int) -> int:
        """Tokens per MLP tile."""
        return -(-tokens // mlp_tiles(tokens, hidden, self.tiled_mlp_num_shards))


def offloaded_layers(layers: int, two_level: bool = False) -> int:
    """Layers whose input activation offloading keeps in host memory: all, or with two-level checkpointing
    layers 0, 2, 4, ... (the others are made again from them in the backward)."""
    return -(-layers // 2) if two_level else layers


def mlp_tiles(tokens: int, hidden: int, num_shards: int | None = None) -> int:
    """Tiles of an MLP call over ``tokens`` tokens: ``num_shards``, by default ceil(tokens / hidden) as in ALST."""
    tiles = num_shards or -(-tokens // hidden)
    return max(1, min(tiles, tokens))


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of one rank for a micro batch: the peak, which phase sets it, host bytes."""

    peak: float
    phase: str
    phases: dict[str, float]
    host: float


def activation_memory(shape: ModelShape, setup: ActivationSetup, tokens: int) -> ActivationEstimate:
    """Peak activation bytes of one rank training ``tokens`` tokens (its shard of a micro batch).

    The peak is the largest of three moments: the end of the forward pass (checkpoints and one
    layer's forward), the loss (checkpoints and the loss's working set) and the backward of the
    last layer (checkpoints, the incoming gradient and one recomputed layer). With
    ``setup.reference_forward`` a fourth: the reference's forward without gradients
    (:func:`no_grad_forward_memory`), which keeps nothing and so stays below the training forward.
    Model states are not included (:func:`fsdp_state_memory`, :func:`zero_state_memory`).
    """
    b = setup.dtype_bytes
    key = _precision_and_adapter(setup)
    tiled = setup.tiled_mlp
    layer = _layer_bytes(setup)
    hidden_row = shape.hidden * b  # one token's hidden state
    if not setup.gradient_checkpointing:
        saved = (layer.saved or LAYER_BYTES[(*key, False)].saved).per_token(shape)  # tiled: the untiled row
        kept, host = shape.layers * saved * tokens, 0.0
    elif setup.offload:
        # Fitted: OFFLOAD_ROWS_ON_DEVICE layers' inputs stay on the device (two-level checkpointing keeps the
        # same rows: its regenerated input replaces the one it did not offload), the offloaded ones in host memory.
        kept = min(OFFLOAD_ROWS_ON_DEVICE, shape.layers) * hidden_row * tokens
        host = offloaded_layers(shape.layers, setup.two_level) * hidden_row * tokens
    else:
        kept, host = shape.layers * hidden_row * tokens, 0.0
    tile = _forward_tile(shape, setup, tokens)
    if tiled and not setup.lora:  # the MLP weights' gradients, summed over the tiles
        tile += 2 * 3 * shape.hidden * shape.intermediate * b
    attention = _attention_buffers(shape, setup) * tokens
    forward = kept + layer.forward.per_token(shape) * tokens + tile + attention
    loss = _loss_bytes(shape, setup, tokens)
    # The incoming gradient and the residual stream's (two hidden rows), one recomputed layer, its buffers.
    flash = flash_backward_bytes(shape, b) * tokens if setup.flash_attention else 0.0
    backward = (
        kept
        + 2 * hidden_row * tokens
        + layer.backward.per_token(shape) * tokens
        + tile
        + 2 * attention
        + flash
    )
    phases = {"forward": forward, "loss": kept + loss, "layer backward": backward}
    if setup.offload and setup.two_level and setup.gradient_checkpointing:
        # A layer's input made again in the backward: the layer before runs its forward (keeping nothing)
        # while the incoming gradient and the residual stream's wait.
        phases["regeneration"] = forward + 2 * hidden_row * tokens
    if setup.reference_forward:
        phases["reference forward"] = no_grad_forward_memory(shape, setup, tokens)
    phase = max(phases, key=phases.__getitem__)
    return ActivationEstimate(peak=phases[phase], phase=phase, phases=phases, host=host)


def no_grad_forward_memory(shape: ModelShape, setup: ActivationSetup, tokens: int) -> float:
    """Peak activation bytes of one rank's forward pass over ``tokens`` tokens without gradients.

    Preference training runs such passes: the reference forward of each micro batch (the adapter
    disabled), the first pass of ``precompute_ref_log_probs``, and evaluation (policy and reference).
    Nothing is kept for a backward, so the peak is the running layer's input (one hidden row) with
    either one layer's forward working set (the same as under gradient checkpointing, whose forward
    also runs without saving; its MLP tile and the CP backend's K/V buffers) or the loss's. The
    loss's is the training loss's working set: an upper bound, since without gradients it holds
    none of the logits' gradients.
    """
    hidden_row = shape.hidden * setup.dtype_bytes
    layer = _layer_bytes(setup)
    attention = _attention_buffers(shape, setup) * tokens
    layer_forward = layer.forward.per_token(shape) * tokens + _forward_tile(shape, setup, tokens) + attention
    return hidden_row * tokens + max(layer_forward, _loss_bytes(shape, setup, tokens))


def _precision_and_adapter(setup: ActivationSetup) -> tuple[str, str]:
    return ("mixed" if setup.mixed_precision else "fp32", "lora" if setup.lora else "full")


def _layer_bytes(setup: ActivationSetup) -> LayerBytes:
    """The per-token coefficients of one decoder layer for ``setup``."""
    key = (*_precision_and_adapter(setup), setup.tiled_mlp)
    layer = LAYER_BYTES[key]
    if setup.recompute_norms:
        layer = RECOMPUTED_NORMS_LAYER_BYTES.get(key, layer)
    return layer


def _forward_tile(shape: ModelShape, setup: ActivationSetup, tokens: int) -> float:
    """One MLP tile's intermediate activations (0 without the tiled MLP)."""
    if not setup.tiled_mlp:
        return 0.0
    untiled = LAYER_BYTES[(*_precision_and_adapter(setup), False)].backward
    return untiled.i * shape.intermediate * setup.tile_tokens(tokens, shape.hidden)


def _loss_bytes(shape: ModelShape, setup: ActivationSetup, tokens: int) -> float:
    """The loss's working set over ``tokens`` tokens, above the checkpoints (with the final norm and the head)."""
    if setup.head_loss:
        # What the loss keeps per token (the gradient it hands back among it), and one chunk in flight.
        chunk = _chunk_bytes("head", shape, min(setup.loss_chunk_elements, tokens * shape.vocab))
        loss = _layer_bytes(setup).head_loss.per_token(shape) * tokens + chunk
        if not setup.lora:  # the output layer's weight gradient, summed over the chunks
            loss += 2 * shape.vocab * shape.hidden * setup.dtype_bytes
        return loss
    if tokens * shape.vocab > setup.loss_chunk_elements:
        return _logits_loss("chunked", shape) * tokens + _chunk_bytes(
            "logits", shape, setup.loss_chunk_elements
        )
    return _logits_loss("whole", shape) * tokens


def _logits_loss(mode: str, shape: ModelShape) -> float:
    """Per-token bytes of the loss from whole or chunked logits."""
    vocab, hidden, token, rotary = LOGITS_LOSS_BYTES[mode]
    return vocab * shape.vocab + hidden * shape.hidden + token + rotary * shape.head_dim


def _chunk_bytes(kind: str, shape: ModelShape, elements: int) -> float:
    """One chunk of ``elements`` logits in flight (``kind``: "head" or "logits")."""
    per_logit, per_hidden = CHUNK_BYTES[kind]
    return elements * (per_logit + per_hidden * shape.hidden / shape.vocab)


def _attention_buffers(shape: ModelShape, setup: ActivationSetup) -> float:
    """Per-token bytes of a CP backend's K/V buffers in one layer's forward (twice that in the backward).

    From the buffer sizes in the backends' source (not measured): each backend's
    ``attention_buffer_bytes`` (:class:`cptune.parallel.backends.spec.BackendPolicy`).
    """
    if setup.cp_size <= 1 or setup.attention_buffers is None:
        return 0.0
    return setup.attention_buffers(shape, setup.cp_size, setup.dtype_bytes)


def longest_tokens(
    shape: ModelShape, setup: ActivationSetup, budget: float, *, step: int = 1024, limit: int = 1 << 27
) -> int:
    """Most tokens per rank (a multiple of ``step``) whose activation peak fits ``budget`` bytes; 0 if none."""
    if budget <= 0 or activation_memory(shape, setup, step).peak > budget:
        return 0
    low, high = 1, limit // step  # in steps; the peak grows with the tokens
    while low < high:
        mid = (low + high + 1) // 2
        if activation_memory(shape, setup, mid * step).peak <= budget:
            low = mid
        else:
            high = mid - 1
    return low * step


@dataclass(frozen=True)
class Longest:
    """The longest sequence per rank that fits both the GPU and the host, and which of the two binds.

    Attributes:
        tokens: Tokens per rank (a multiple of the search's step); 0 if none fit.
        limit: ``"GPU memory"`` or ``"host RAM"``: the one that allows fewer tokens.
        gpu_tokens: The most tokens the GPU alone allows.
        host_tokens: The most tokens the host alone allows (None: nothing offloaded, or no host bound).
    """

    tokens: int
    limit: str
    gpu_tokens: int
    host_tokens: int | None


def longest_within(
    shape: ModelShape,
    setup: ActivationSetup,
    gpu_budget: float,
    host_budget: float | None,
    *,
    step: int = 1024,
) -> Longest:
    """Most tokens per rank whose activation peak fits ``gpu_budget`` bytes and whose offloaded layer inputs
    fit ``host_budget`` bytes of host RAM (None: not bounded), naming the limit that binds."""
    gpu_tokens = longest_tokens(shape, setup, gpu_budget, step=step)
    host_per_token = activation_memory(shape, setup, step).host / step
    if host_budget is None or not host_per_token:
        return Longest(gpu_tokens, "GPU memory", gpu_tokens, None)
    host_tokens = max(0, int(host_budget // host_per_token) // step * step)
    if host_tokens < gpu_tokens:
        return Longest(host_tokens, "host RAM", gpu_tokens, host_tokens)
    return Longest(gpu_tokens, "GPU memory", gpu_tokens, host_tokens)
