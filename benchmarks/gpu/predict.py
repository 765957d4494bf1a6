"""The memory model's predictions for the Llama-3.1-8B LoRA recipe of the GPU scripts.

What ``cptune validate`` computes for that recipe (:mod:`cptune.parallel.memory`), as
functions of the settings, so that the GPU script can write the prediction beside every
measurement and the results page can print the predicted limits (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.gpu.flops import LLAMA_31_8B, ModelShape, lora_parameters
from cptune.parallel import memory

GiB = float(1 << 30)
H100_BYTES = 81_559 * (1 << 20)  # an H100 80GB as nvidia-smi reports it
GPU_RESERVE = 2 * (1 << 30)  # cptune.run.memory_plan.GPU_RESERVE
LORA_RANK = 16

# The recipe keys of the settings compared on the GPU, and what the memory model calls them.
SETTINGS = {
    "today": {},
    "activation_offloading": {"activation_offloading": True},
    "tiled_mlp": {"tiled_mlp": True},
    "cut_cross_entropy": {"cut_cross_entropy": True},
    "everything": {"activation_offloading": True, "tiled_mlp": True, "cut_cross_entropy": True},
}


def activation_shape(shape: ModelShape = LLAMA_31_8B) -> memory.ModelShape:
    return memory.ModelShape(
        layers=shape.layers,
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab=shape.vocab,
    )


def setup_for(keys: dict, cp_size: int = 1, cp_backend: str = "ring-flash-attn") -> memory.ActivationSetup:
    """The activation setup of the bf16 LoRA recipe (gradient checkpointing on) with these recipe keys."""
    return memory.ActivationSetup(
        mixed_precision=True,
        lora=True,
        offload=bool(keys.get("activation_offloading")),
        tiled_mlp=bool(keys.get("tiled_mlp")),
        tiled_mlp_num_shards=keys.get("tiled_mlp_num_shards"),
        head_loss=bool(keys.get("cut_cross_entropy")),
        cp_size=cp_size,
        cp_backend=cp_backend if cp_size > 1 else None,
    )


def lora_states(shape: ModelShape = LLAMA_31_8B, shard_ranks: int = 1) -> float:
    """Weights, gradients and AdamW state per GPU: bf16 base, fp32 adapter (FSDP2 over ``shard_ranks``)."""
    adapter = lora_parameters(shape, LORA_RANK)
    return memory.fsdp_state_memory(
        total=shape.parameters + adapter,
        trainable=adapter,
        optimizer_elements=2 * adapter,
        dtype_bytes=2,
        shard_ranks=shard_ranks,
        trained_bytes=4,
    ).total


@dataclass(frozen=True)
class Prediction:
    tokens_per_gpu: int
    peak_gib: float
    phase: str
    host_gib: float


def predict(keys: dict, tokens: int, cp_size: int = 1, shard_ranks: int = 1) -> Prediction:
    """Predicted peak per GPU (states + activations) for ``tokens`` tokens per GPU."""
    estimate = memory.activation_memory(activation_shape(), setup_for(keys, cp_size), tokens)
    return Prediction(
        tokens,
        (lora_states(shard_ranks=shard_ranks) + estimate.peak) / GiB,
        estimate.phase,
        estimate.host / GiB,
    )


def longest(keys: dict, cp_size: int = 1, shard_ranks: int = 1, gpu_bytes: float = H100_BYTES) -> Prediction:
    """The longest tokens per GPU the memory model fits into ``gpu_bytes`` (less the reserve)."""
    budget = gpu_bytes - GPU_RESERVE - lora_states(shard_ranks=shard_ranks)
    tokens = memory.longest_tokens(activation_shape(), setup_for(keys, cp_size), budget)
    return predict(keys, tokens, cp_size, shard_ranks)
