"""The per-rank model-state estimate, checked against hand arithmetic."""

import pytest

from cptune.parallel.memory import (
    OptimizerState,
    StateLayout,
    format_bytes,
    fsdp_state_memory,
    gathered_in_flight,
    optimizer_state,
    state_memory,
    zero_state_memory,
)

# An 8B-class model: P parameters, all trained, AdamW.
P = 8_000_000_000
WHOLE = StateLayout()


def test_full_finetune_of_8b_in_bf16_needs_sharding():
    adam = optimizer_state("adamw_torch", [(P,)])
    assert adam == OptimizerState(2 * P)
    ddp = fsdp_state_memory(total=P, trainable=P, optimizer=adam, dtype_bytes=2, shard_ranks=1)
    # DDP trains in the loaded dtype: bf16 weights, gradients and moments, 8 bytes per parameter.
    assert (ddp.weights, ddp.gradients, ddp.optimizer) == (2 * P, 2 * P, 4 * P)
    fsdp = fsdp_state_memory(total=P, trainable=P, optimizer=adam, dtype_bytes=2, shard_ranks=8)
    # FSDP2 with mixed precision keeps fp32 trained weights: 16 bytes per parameter, over 8 ranks.
    assert fsdp.total == 16 * P // 8
    common = {"total": P, "trainable": P, "optimizer": adam, "dtype_bytes": 2}
    assert state_memory(**common, layout=WHOLE) == ddp
    assert state_memory(**common, layout=StateLayout("fsdp", 8)) == fsdp
    # Tensor parallelism splits each weight over 2 tp ranks before FSDP2 shards it over 4.
    tp = StateLayout("fsdp", 4, tp_size=2)
    assert state_memory(**common, layout=tp) == fsdp
    assert tp.describe() == "FSDP2 over 4 ranks × 2 tp"


def test_lora_shards_the_frozen_base_too():
    base, adapter = 1_000_000, 10_000
    adam = optimizer_state("adamw_torch", [(100, 100)])
    memory = fsdp_state_memory(
        total=base + adapter, trainable=adapter, optimizer=adam, dtype_bytes=2, shard_ranks=4
    )
    assert memory.weights == (base * 2 + adapter * 4) // 4
    assert memory.gradients == adapter * 4 // 4
    assert memory.optimizer == 2 * adapter * 4 // 4


def test_an_unsharded_lora_adapter_is_counted_in_fp32():
    # peft upcasts a bf16 adapter to fp32: 10,000 adapter weights take 40,000 bytes, and so do their
    # gradients; AdamW keeps two fp32 moments (80,000 bytes). The bf16 base: 2,000,000 bytes.
    memory = state_memory(
        total=1_010_000,
        trainable=10_000,
        optimizer=optimizer_state("adamw_torch", [(100, 100)]),
        dtype_bytes=2,
        layout=WHOLE,
        lora=True,
    )
    assert (memory.weights, memory.gradients, memory.optimizer) == (2_040_000, 40_000, 80_000)


def test_eight_bit_optimizer_state_is_one_byte_per_element_in_any_dtype():
    # A bf16 full fine-tune of 1,000 weights with AdamW 8-bit: two moments of 1 byte each = 2,000 bytes,
    # not the 1,000 that counting them as a quarter of a bf16 element per moment would give.
    eight_bit = optimizer_state("adamw_bnb_8bit", [(1000,)])
    assert eight_bit == OptimizerState(0, low_bit_bytes=2000)
    for dtype_bytes in (2, 4):
        memory = state_memory(
            total=1000, trainable=1000, optimizer=eight_bit, dtype_bytes=dtype_bytes, layout=WHOLE
        )
        assert memory.optimizer == 2000
    # FSDP2 over 4 ranks and ZeRO-1 over 4 ranks divide the same 2,000 bytes (ZeRO adds its fp32 master copy).
    assert (
        state_memory(
            total=1000, trainable=1000, optimizer=eight_bit, dtype_bytes=2, layout=StateLayout("fsdp", 4)
        ).optimizer
        == 500
    )
    zero = state_memory(
        total=1000, trainable=1000, optimizer=eight_bit, dtype_bytes=2, layout=StateLayout("zero", 4, 1)
    )
    assert zero.optimizer == (2000 + 4000) // 4
    assert optimizer_state("adamw_torch_4bit", [(1001,)]) == OptimizerState(
        0, low_bit_bytes=1001
    )  # 2 x 4 bits


def test_a_quantized_base_takes_its_quantized_bytes_in_every_layout():
    # 1,000,000 weights, 900,000 of them stored in 8 bits (1 byte instead of bf16's 2), LoRA of 1,000.
    common = {
        "total": 1_001_000,
        "trainable": 1_000,
        "optimizer": OptimizerState(2_000),
        "dtype_bytes": 2,
        "lora": True,
        "quantized": 900_000,
        "quantized_bytes": 1.0,
    }
    whole = state_memory(**common, layout=WHOLE)
    assert whole.weights == 100_000 * 2 + 900_000 * 1 + 1_000 * 4
    # ZeRO-3 over 4 ranks shards the weights (stored in the training dtype there, the adapter too).
    zero3 = state_memory(**common, layout=StateLayout("zero", 4, 3))
    assert zero3.weights == (1_001_000 * 2) // 4 - (900_000 * 2 - 900_000) // 4
    zero1 = state_memory(**common, layout=StateLayout("zero", 4, 1))
    assert zero1.weights == 1_001_000 * 2 - 900_000
    assert StateLayout("zero", 4, 3).describe() == "ZeRO-3 over 4 ranks"


def test_fsdp2_shards_4bit_weights_stored_in_a_float_dtype_and_not_those_stored_in_uint8():
    """accelerate's fsdp2_prepare_model leaves frozen non-float Params4bit out of fully_shard (ignored_params)."""
    common = {
        "total": 1_001_000,
        "trainable": 1_000,
        "optimizer": OptimizerState(2_000),
        "dtype_bytes": 2,
        "lora": True,
        "quantized": 900_000,
        "quantized_bytes": 0.5,
        "layout": StateLayout("fsdp", 4),
    }
    # The rest (100,000 bf16 weights, the fp32 adapter) is sharded over the 4 ranks either way.
    rest = -(-(100_000 * 2 + 1_000 * 4) // 4)
    assert state_memory(**common, quantized_sharded=False).weights == rest + 450_000
    sharded = state_memory(**common).weights
    assert sharded == -(-(1_001_000 * 2 - 1_000 * 2 + 1_000 * 4) // 4) - (900_000 * 2 - 450_000) // 4
    assert abs(sharded - (rest + 450_000 // 4)) <= 1


def test_fsdp2_offloaded_states_leave_the_gpu_the_weights_in_flight():
    """offload_params: the sharded states are in host memory; the GPU holds the gathered root unit and two layers."""
    common = {
        "total": 1_001_000,
        "trainable": 1_000,
        "optimizer": OptimizerState(2_000),
        "dtype_bytes": 2,
        "lora": True,
    }
    # 10 decoder layers of 90,000 parameters: the root unit (embeddings, head) is the other 101,000.
    in_flight = gathered_in_flight(1_001_000, 900_000, 90_000, 2)
    assert in_flight == (101_000 + 2 * 90_000) * 2
    for ranks in (1, 4):
        kept = state_memory(**common, layout=StateLayout("fsdp", ranks))
        offloaded = state_memory(
            **common, layout=StateLayout("fsdp", ranks, offload=True), in_flight=in_flight
        )
        assert (offloaded.weights, offloaded.gradients, offloaded.optimizer) == (in_flight, 0, 0)
        assert offloaded.total == in_flight and offloaded.host == kept.total and kept.host == 0
    assert StateLayout("fsdp", 1, offload=True).describe() == "FSDP2 over 1 rank, offloaded to host RAM"


def test_zero_stages_shard_one_more_state_each():
    kwargs = {"total": 100, "trainable": 100, "optimizer": OptimizerState(200), "dtype_bytes": 2, "ranks": 4}
    # Half precision: the optimizer state holds the fp32 moments and an fp32 master copy.
    assert zero_state_memory(**kwargs, stage=0).optimizer == 200 * 4 + 100 * 4
    assert zero_state_memory(**kwargs, stage=1).optimizer == (200 * 4 + 100 * 4) // 4
    assert zero_state_memory(**kwargs, stage=1).gradients == 200
    assert zero_state_memory(**kwargs, stage=2).gradients == 200 // 4
    assert zero_state_memory(**kwargs, stage=2).weights == 200
    assert zero_state_memory(**kwargs, stage=3).weights == 200 // 4


def test_optimizer_state():
    shapes = [(4, 8), (8,)]
    assert optimizer_state("adamw_torch_fused", shapes) == OptimizerState(2 * 40)
    assert optimizer_state("adafactor", shapes) == OptimizerState((4 + 8) + 8)
    assert optimizer_state("sgd", shapes) == OptimizerState(0)
    # Low-bit moments in bytes whatever the dtype: 8-bit one byte, 4-bit half a byte per element.
    assert optimizer_state("adamw_bnb_8bit", shapes) == OptimizerState(0, 2 * 40)
    assert optimizer_state("paged_adamw_32bit", shapes) == OptimizerState(2 * 40)
    assert optimizer_state("adamw_torch_4bit", shapes) == OptimizerState(0, 2 * 40 // 2)
    assert optimizer_state("lion_32bit", shapes) == OptimizerState(40)
    assert optimizer_state("paged_ademamix_8bit", shapes) == OptimizerState(0, 3 * 40)
    assert OptimizerState(10, 3).nbytes(2) == 23
    with pytest.raises(ValueError):
        optimizer_state("galore_adamw", shapes)


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
    assert format_bytes(999.7 * 1024**2) == "1000 MiB"  # was "1e+03 MiB"
    assert format_bytes(999.4 * 1024**2) == "999 MiB"
