"""Per-rank memory of the model states (weights, gradients, optimizer state), as pure arithmetic.

An estimate from parameter counts and dtypes, for ``cptune validate``: it tells
before launching whether a model's states fit, and what sharding them buys.
Activations are not included (they depend on the sequence length and shrink
with context parallelism, see docs/benchmarks.md).

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

from collections.abc import Sequence
from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True)
class StateMemory:
    """Bytes one rank holds for the model states."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def optimizer_state_elements(optimizer: str, trainable_shapes: Sequence[tuple[int, ...]]) -> int:
    """Elements of optimizer state for the trained parameters of these shapes.

    AdamW keeps two moments per element; the Trainer's SGD has no momentum, so no
    state; Adafactor keeps one row and one column vector per matrix (factored
    second moment) and one vector per other parameter.
    """
    numel = sum(_numel(shape) for shape in trainable_shapes)
    if optimizer == "adafactor":
        return sum(shape[-2] + shape[-1] if len(shape) >= 2 else _numel(shape) for shape in trainable_shapes)
    if optimizer == "sgd":
        return 0
    # Low-bit optimizers keep their moments in 8 or 4 bits: counted here as the fp32 elements of the
    # same size (block-wise quantization constants, under 1% more, are left out).
    moments = {"ademamix": 3, "lion": 1, "adagrad": 1, "rmsprop": 1}
    count = next((n for family, n in moments.items() if family in optimizer), 2)
    if "8bit" in optimizer:
        return -(-count * numel // 4)
    if "4bit" in optimizer:
        return -(-count * numel // 8)
    if optimizer.startswith(("adamw", "paged_adamw", "ademamix", "paged_ademamix", "lion", "paged_lion")) or (
        optimizer in ("adagrad", "rmsprop", "rmsprop_bnb", "stable_adamw")
    ):
        return count * numel
    raise ValueError(f"no memory estimate for optimizer {optimizer!r}")


def fsdp_state_memory(
    *,
    total: int,
    trainable: int,
    optimizer_elements: int,
    dtype_bytes: int,
    shard_ranks: int,
) -> StateMemory:
    """Per-rank bytes under FSDP2 over ``shard_ranks`` ranks (1: plain DDP).

    Args:
        total: All parameters.
        trainable: Trained parameters.
        optimizer_elements: Elements of optimizer state (:func:`optimizer_state_elements`).
        dtype_bytes: Bytes per element of the training dtype (2 for bf16/fp16, 4 for fp32).
        shard_ranks: Ranks the states are sharded over; 1 means every rank holds them whole (DDP).
    """
    # accelerate keeps fp32 master weights for trained parameters when sharding with mixed precision;
    # under DDP cptune trains in the dtype it loaded.
    trained_bytes = FP32 if shard_ranks > 1 else dtype_bytes
    weights = (total - trainable) * dtype_bytes + trainable * trained_bytes
    return StateMemory(
        weights=_ceil_div(weights, shard_ranks),
        gradients=_ceil_div(trainable * trained_bytes, shard_ranks),
        optimizer=_ceil_div(optimizer_elements * trained_bytes, shard_ranks),
    )


def zero_state_memory(
    *,
    total: int,
    trainable: int,
    optimizer_elements: int,
    dtype_bytes: int,
    stage: int,
    ranks: int,
) -> StateMemory:
    """Per-rank bytes under DeepSpeed ZeRO ``stage`` (0-3) over ``ranks`` ranks."""
    master = trainable * FP32 if dtype_bytes < FP32 else 0
    optimizer = optimizer_elements * FP32 + master
    return StateMemory(
        weights=_ceil_div(total * dtype_bytes, ranks if stage >= 3 else 1),
        gradients=_ceil_div(trainable * dtype_bytes, ranks if stage >= 2 else 1),
        optimizer=_ceil_div(optimizer, ranks if stage >= 1 else 1),
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
            return f"{value:.0f} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
