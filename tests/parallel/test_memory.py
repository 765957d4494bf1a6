"""The per-rank model-state estimate, checked against hand arithmetic."""

import pytest

from cptune.parallel.memory import (
    format_bytes,
    fsdp_state_memory,
    optimizer_state_elements,
    zero_state_memory,
)

# An 8B-class model: P parameters, all trained, AdamW.
P = 8_000_000_000


def test_full_finetune_of_8b_in_bf16_needs_sharding():
    adam = optimizer_state_elements("adamw_torch", [(P,)])
    assert adam == 2 * P
    ddp = fsdp_state_memory(total=P, trainable=P, optimizer_elements=adam, dtype_bytes=2, shard_ranks=1)
    # DDP trains in the loaded dtype: bf16 weights, gradients and moments, 8 bytes per parameter.
    assert (ddp.weights, ddp.gradients, ddp.optimizer) == (2 * P, 2 * P, 4 * P)
    fsdp = fsdp_state_memory(total=P, trainable=P, optimizer_elements=adam, dtype_bytes=2, shard_ranks=8)
    # FSDP2 with mixed precision keeps fp32 trained weights: 16 bytes per parameter, over 8 ranks.
    assert fsdp.total == 16 * P // 8


def test_lora_shards_the_frozen_base_too():
    base, adapter = 1_000_000, 10_000
    adam = optimizer_state_elements("adamw_torch", [(100, 100)])
    memory = fsdp_state_memory(
        total=base + adapter, trainable=adapter, optimizer_elements=adam, dtype_bytes=2, shard_ranks=4
    )
    assert memory.weights == (base * 2 + adapter * 4) // 4
    assert memory.gradients == adapter * 4 // 4
    assert memory.optimizer == 2 * adapter * 4 // 4


def test_zero_stages_shard_one_more_state_each():
    kwargs = {"total": 100, "trainable": 100, "optimizer_elements": 200, "dtype_bytes": 2, "ranks": 4}
    # Half precision: the optimizer state holds the fp32 moments and an fp32 master copy.
    assert zero_state_memory(**kwargs, stage=0).optimizer == 200 * 4 + 100 * 4
    assert zero_state_memory(**kwargs, stage=1).optimizer == (200 * 4 + 100 * 4) // 4
    assert zero_state_memory(**kwargs, stage=1).gradients == 200
    assert zero_state_memory(**kwargs, stage=2).gradients == 200 // 4
    assert zero_state_memory(**kwargs, stage=2).weights == 200
    assert zero_state_memory(**kwargs, stage=3).weights == 200 // 4


def test_optimizer_state_elements():
    shapes = [(4, 8), (8,)]
    assert optimizer_state_elements("adamw_torch_fused", shapes) == 2 * 40
    assert optimizer_state_elements("adafactor", shapes) == (4 + 8) + 8
    assert optimizer_state_elements("sgd", shapes) == 0
    # Low-bit moments, counted as the fp32 elements of the same bytes: 8-bit is a quarter, 4-bit an eighth.
    assert optimizer_state_elements("adamw_bnb_8bit", shapes) == 2 * 40 // 4
    assert optimizer_state_elements("paged_adamw_32bit", shapes) == 2 * 40
    assert optimizer_state_elements("adamw_torch_4bit", shapes) == 2 * 40 // 8
    assert optimizer_state_elements("lion_32bit", shapes) == 40
    assert optimizer_state_elements("paged_ademamix_8bit", shapes) == 3 * 40 // 4
    with pytest.raises(ValueError):
        optimizer_state_elements("galore_adamw", shapes)


def test_quantized_bytes_per_weight():
    from cptune.parallel.memory import quantized_bytes_per_weight

    # NF4 with double quantization: 4 bits + 8-bit scales per 64 weights + fp32 scales per 256 blocks.
    assert quantized_bytes_per_weight(4) == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))
    assert quantized_bytes_per_weight(4, double_quant=False) == 0.5 + 4 / 64
    assert quantized_bytes_per_weight(8) == 1.0


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(16 * 1024**3) == "16 GiB"
    assert format_bytes(1020 * 1024**2) == "1020 MiB"  # was "1.02e+03 MiB"
