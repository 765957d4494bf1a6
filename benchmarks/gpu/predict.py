"""The memory model's predictions for the Llama-3.1-8B LoRA recipe of the GPU scripts.

What ``cptune validate`` computes for that recipe (:mod:`cptune.parallel.memory`), as
functions of the settings, so that the GPU script can write the prediction beside every
measurement and the results page can print the predicted limits (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
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
    # every feature, the forward under bf16 autocast and cptune's patches, as the Trainer runs it: the
    # path the memory model describes (mixed precision), so its keys are everything's
    "trainer": {"activation_offloading": True, "tiled_mlp": True, "cut_cross_entropy": True},
    "trainer_norms": {
        "activation_offloading": True,
        "tiled_mlp": True,
        "recompute_norms": True,
        "cut_cross_entropy": True,
    },
    "trainer_two_level": {
        "activation_offloading": "two_level",
        "tiled_mlp": True,
        "recompute_norms": True,
        "cut_cross_entropy": True,
    },
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


def setup_for(keys: dict, cp_size: int = 1, mixed: bool = True) -> memory.ActivationSetup:
    """The activation setup of the LoRA recipe (gradient checkpointing on; bf16 unless not ``mixed``), with
    ring-flash-attn's K/V buffers at cp > 1.

    The GPU image has no pydantic, so no recipe is validated here: the ring backend's policy reads the
    one key its buffers depend on from the keys (``heads_k_stride``, 1 unless they set it).
    """
    from types import SimpleNamespace

    from cptune.parallel.backends.ring_flash_attn.policy import POLICY as RING

    keys_read = SimpleNamespace(heads_k_stride=keys.get("heads_k_stride", 1))
    return memory.ActivationSetup(
        mixed_precision=mixed,
        lora=True,
        offload=bool(keys.get("activation_offloading")),
        two_level=keys.get("activation_offloading") == "two_level",
        tiled_mlp=bool(keys.get("tiled_mlp")),
        tiled_mlp_num_shards=keys.get("tiled_mlp_num_shards"),
        recompute_norms=bool(keys.get("recompute_norms")),
        head_loss=bool(keys.get("cut_cross_entropy")),
        cp_size=cp_size,
        attention_buffers=functools.partial(RING.attention_buffer_bytes, keys_read) if cp_size > 1 else None,
    )


def lora_states(
    shape: ModelShape = LLAMA_31_8B, shard_ranks: int = 1, mixed: bool = True, qlora: bool = False
) -> float:
    """Weights, gradients and AdamW state per GPU: the base in bf16 (fp32 unless ``mixed``), fp32 adapter.

    ``qlora``: the decoder's linear weights in 4 bits (NF4 with double quantization, as
    :func:`cptune.parallel.memory.state_memory` counts a QLoRA base); embeddings, head and norms stay bf16.
    """
    adapter = lora_parameters(shape, LORA_RANK)
    states = memory.fsdp_state_memory(
        total=shape.parameters + adapter,
        trainable=adapter,
        optimizer=memory.OptimizerState(2 * adapter),
        dtype_bytes=2 if mixed else 4,
        shard_ranks=shard_ranks,
        trained_bytes=4,
    ).total
    if not qlora:
        return states
    quantized = linear_weights(shape)
    saved = quantized * (2 if mixed else 4) - quantized * memory.quantized_bytes_per_weight(4)
    return states - saved / shard_ranks


def linear_weights(shape: ModelShape) -> int:
    """Weights of the decoder's linear layers (what QLoRA quantizes)."""
    q_out, kv_out = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = 2 * shape.hidden * q_out + 2 * shape.hidden * kv_out + 3 * shape.hidden * shape.intermediate
    return shape.layers * per_layer


@dataclass(frozen=True)
class Prediction:
    tokens_per_gpu: int
    peak_gib: float
    phase: str
    host_gib: float


def predict(
    keys: dict,
    tokens: int,
    cp_size: int = 1,
    shard_ranks: int = 1,
    shape: ModelShape = LLAMA_31_8B,
    mixed: bool = True,
    qlora: bool = False,
) -> Prediction:
    """Predicted peak per GPU (states + activations) for ``tokens`` tokens per GPU."""
    setup = setup_for(keys, cp_size, mixed=mixed)
    estimate = memory.activation_memory(activation_shape(shape), setup, tokens)
    states = lora_states(shape, shard_ranks, mixed, qlora)
    return Prediction(tokens, (states + estimate.peak) / GiB, estimate.phase, estimate.host / GiB)


def longest(
    keys: dict,
    cp_size: int = 1,
    shard_ranks: int = 1,
    gpu_bytes: float = H100_BYTES,
    shape: ModelShape = LLAMA_31_8B,
    mixed: bool = True,
    reserve: float = GPU_RESERVE,
    step: int = 1024,
    qlora: bool = False,
) -> Prediction:
    """The longest tokens per GPU (a multiple of ``step``) the memory model fits into ``gpu_bytes - reserve``."""
    budget = gpu_bytes - reserve - lora_states(shape, shard_ranks, mixed, qlora)
    setup = setup_for(keys, cp_size, mixed=mixed)
    tokens = memory.longest_tokens(activation_shape(shape), setup, budget, step=step)
    return predict(keys, tokens, cp_size, shard_ranks, shape, mixed, qlora)


HOST_PINNABLE_FRACTION = 0.9  # cptune.run.memory_plan.HOST_PINNABLE_FRACTION


def offloaded_lora_states(shape: ModelShape = LLAMA_31_8B, qlora: bool = False) -> memory.StateMemory:
    """The states of ``fsdp_config.offload_params`` at one process: sharded over a mesh of one, kept in host
    RAM; on the GPU the gathered root unit (embeddings, final norm, head) and two decoder layers, in bf16."""
    adapter = lora_parameters(shape, LORA_RANK)
    total, in_layers = shape.parameters + adapter, shape.layer_parameters + adapter
    return memory.state_memory(
        total=total,
        trainable=adapter,
        optimizer=memory.OptimizerState(2 * adapter),
        dtype_bytes=2,
        layout=memory.StateLayout("fsdp", 1, offload=True),
        lora=True,
        quantized=linear_weights(shape) if qlora else 0,
        quantized_bytes=memory.quantized_bytes_per_weight(4),
        in_flight=memory.gathered_in_flight(total, in_layers, in_layers // shape.layers, 2),
    )


def longest_on_host(
    keys: dict,
    host_bytes: float,
    qlora: bool = False,
    offload_params: bool = False,
    gpu_bytes: float = H100_BYTES,
    shape: ModelShape = LLAMA_31_8B,
) -> tuple[memory.Longest, float]:
    """The longest tokens on one GPU with ``host_bytes`` of host RAM, as ``cptune validate`` bounds it (the
    GPU less the reserve and the states; 90% of the host less FSDP2's offloaded states), and the pinned
    host bytes at that length (layer inputs and offloaded states)."""
    if offload_params:
        states = offloaded_lora_states(shape, qlora)
        on_gpu, on_host = states.total, states.host
    else:
        on_gpu, on_host = lora_states(shape, qlora=qlora), 0
    setup = setup_for(keys)
    longest = memory.longest_within(
        activation_shape(shape),
        setup,
        gpu_bytes - GPU_RESERVE - on_gpu,
        HOST_PINNABLE_FRACTION * host_bytes - on_host,
    )
    pinned = memory.activation_memory(activation_shape(shape), setup, max(longest.tokens, 1)).host + on_host
    return longest, pinned
