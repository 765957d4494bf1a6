"""The activation memory model (cptune.parallel.memory), checked against measurements.

Two sets of measurements:

- The H100 runs on docs/benchmarks.md (Llama-3.1-8B-shaped, LoRA r=16 on every linear layer, bf16,
  gradient checkpointing, one GPU): 25.9 GiB at 8K tokens and 35.9 GiB at 16K with the chunked
  loss, 29.4 and 43.2 GiB before it; 48K tokens trained and 64K ran out of memory. The model
  predicts 26.0 / 36.0 / 29.5 / 43.3 GiB: +0.5%, +0.3%, +0.2%, +0.3%, and a limit of 50,176 tokens.
- CPU traces of tiny Llamas (torch's allocator, every tensor): one step in-process, fp32 and bf16
  mixed precision (autocast and fp32 model outputs, as accelerate runs bf16), LoRA and full, each
  memory feature on and off. Over 40 such combinations (the tiny model with vocab 768, and one whose
  MLP sets the peak) the prediction was 7% under to 9% over the trace; five run here (one with
  two-level checkpointing), tolerance 15%.
"""

from __future__ import annotations

import pytest
import torch

from cptune.parallel.memory import (
    ActivationSetup,
    ModelShape,
    StateLayout,
    activation_memory,
    longest_tokens,
    mlp_tiles,
    optimizer_state,
    state_memory,
)

GiB = 1 << 30
LLAMA_8B = ModelShape(
    layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256
)
# Parameters of Llama-3.1-8B (untied head) and of its LoRA r=16 adapter on every linear layer
# (from the meta-device model, as `cptune validate` counts them).
BASE_PARAMETERS, LORA_PARAMETERS = 8_030_261_248, 41_943_040
H100_USABLE = 81_559 * (1 << 20) - 2 * GiB  # what cptune validate assumes for an H100 80GB


def lora_states() -> float:
    return state_memory(
        total=BASE_PARAMETERS + LORA_PARAMETERS,
        trainable=LORA_PARAMETERS,
        optimizer=optimizer_state("adamw_torch_fused", [(LORA_PARAMETERS,)]),
        dtype_bytes=2,
        layout=StateLayout(),
        lora=True,
    ).total


@pytest.mark.parametrize(
    ("tokens", "chunked", "measured_gib"),
    [(8192, True, 25.9), (16384, True, 35.9), (8192, False, 29.4), (16384, False, 43.2)],
    ids=["8k", "16k", "8k-before-chunked-loss", "16k-before-chunked-loss"],
)
def test_llama_8b_peaks_match_the_h100_runs(tokens, chunked, measured_gib):
    setup = ActivationSetup(
        mixed_precision=True, lora=True, loss_chunk_elements=(1 << 26) if chunked else 1 << 62
    )
    predicted = (lora_states() + activation_memory(LLAMA_8B, setup, tokens).peak) / GiB
    assert abs(predicted - measured_gib) <= 0.03 * measured_gib, predicted


def test_llama_8b_longest_sequence_matches_the_h100_search():
    """48K tokens trained on the H100 and 64K did not; the model puts the limit between them."""
    setup = ActivationSetup(mixed_precision=True, lora=True)
    longest = longest_tokens(LLAMA_8B, setup, H100_USABLE - lora_states())
    assert 49_152 <= longest < 65_536


def test_memory_features_move_the_limit_and_the_peak():
    budget = H100_USABLE - lora_states()
    today = ActivationSetup(mixed_precision=True, lora=True)
    everything = ActivationSetup(
        mixed_precision=True, lora=True, offload=True, tiled_mlp=True, head_loss=True
    )
    base = activation_memory(LLAMA_8B, today, 65536)
    offloaded = activation_memory(LLAMA_8B, ActivationSetup(True, True, offload=True), 65536)
    # Offloading moves the checkpoints (32 layers x 8 KiB per token) to the host; two layers' inputs
    # stay on the device (measured on CPU traces at 2 and 4 layers: benchmarks/memory_coefficients.py).
    assert offloaded.host == 32 * 4096 * 2 * 65536
    assert base.peak - offloaded.peak == pytest.approx(30 * 4096 * 2 * 65536)
    # With the head loss the logits no longer set the peak; with tiles the MLP does not either.
    assert activation_memory(LLAMA_8B, ActivationSetup(True, True, head_loss=True), 65536).phase != "loss"
    longest = longest_tokens(LLAMA_8B, everything, budget)
    assert longest > 6 * longest_tokens(LLAMA_8B, today, budget)
    assert activation_memory(LLAMA_8B, everything, longest).phase == "layer backward"


def test_llama_8b_with_every_feature_against_the_gpu_check_b():
    """Check B (issue 27; one H200 capped to 79.6 GiB): 22.2, 36.3 and 77.5 GiB at 32,768, 98,304 and
    294,912 tokens with every feature on. It ran without autocast, so every LoRA layer kept an fp32 copy
    of its input: the CPU traces measure what that adds (benchmarks/memory_model_report.py). The model
    for that setup is never under the GPU (its FlashAttention term is an upper bound) and within issue 27's
    10% goal; before the refit it was under at 294,912 (73.7 GiB, -4.9%, for cptune's own setup)."""
    import json

    from benchmarks import memory_coefficients, memory_model_report

    traces = json.loads(memory_coefficients.TRACES.read_text())["traces"]
    for tokens, measured, _, check_b_setup in memory_model_report.check_b_rows(traces):
        assert measured <= check_b_setup <= 1.10 * measured, (tokens, check_b_setup, measured)


def test_llama_8b_on_the_trainers_path_against_the_gpu():
    """The step as cptune's Trainer runs it (bf16 autocast, the LoRA input patch), every feature on, one
    H200 capped to 79.6 GiB: 20.48 / 31.09 / 69.71 GiB at 32,768 / 98,304 / 344,064 tokens, and with
    recompute_norms 19.17 / 26.22 GiB at 32,768 / 98,304, and with two_level as well 72.00 / 79.05 GiB
    at 524,288 / 589,824 (8 layers' peaks + the other 24 layers' states; docs/benchmarks/gpu_results.json).
    The model is never under the GPU and at most GPU_GOAL (15%) over. Before it counted recompute_norms it
    gave the norms run the plain run's peaks: 15% and 29% over; before it counted the KV heads' dK/dV of
    FlashAttention's backward it was 1.9% and 2.1% under at 524,288 and 589,824 tokens."""
    from benchmarks import memory_model_report

    rows = memory_model_report.trainer_rows()
    assert {setting for setting, *_ in rows} == {"trainer", "trainer_norms", "trainer_two_level"}
    for setting, tokens, measured, model in rows:
        assert measured <= model <= (1 + memory_model_report.GPU_GOAL) * measured, (setting, tokens, model)


def test_recompute_norms_lowers_the_layer_backward_only_where_fitted():
    """The fitted row with the norms recomputed (every feature, mixed-precision LoRA) sets a lower peak;
    a setup without a fitted row keeps the row without it (an upper bound: recomputing only drops bytes)."""
    everything = ActivationSetup(True, True, offload=True, tiled_mlp=True, head_loss=True)
    norms = ActivationSetup(True, True, offload=True, tiled_mlp=True, head_loss=True, recompute_norms=True)
    tokens = 131_072
    assert (
        activation_memory(LLAMA_8B, norms, tokens).peak < activation_memory(LLAMA_8B, everything, tokens).peak
    )
    plain, plain_norms = ActivationSetup(True, True), ActivationSetup(True, True, recompute_norms=True)
    assert activation_memory(LLAMA_8B, plain_norms, tokens) == activation_memory(LLAMA_8B, plain, tokens)


def test_offloading_and_flash_attention_set_the_8b_limit_with_every_feature():
    """cptune's run (autocast, LoRA inputs kept once) holds less per token than check B's run, which
    trained 294,912 tokens: the model puts its limit above that, in the layer backward, and the GPU-only
    FlashAttention buffers are part of it: for Llama-3.1-8B in bf16 the fp32 dQ accumulator (16 KiB per
    token) and dK/dV expanded to the 32 query heads (16 KiB) less the expanded row the CPU's backward
    holds (8 KiB), and the 8 KV heads' dK/dV the expanded ones are summed into (4 KiB): 28 KiB."""
    from cptune.parallel.memory import flash_backward_bytes

    assert flash_backward_bytes(LLAMA_8B, 2) == (16 + 16 - 8 + 4) * 1024
    everything = ActivationSetup(True, True, offload=True, tiled_mlp=True, head_loss=True)
    budget = H100_USABLE - lora_states()
    longest = longest_tokens(LLAMA_8B, everything, budget)
    assert longest > 294_912
    assert activation_memory(LLAMA_8B, everything, longest).phase == "layer backward"
    without_flash = ActivationSetup(
        True, True, offload=True, tiled_mlp=True, head_loss=True, flash_attention=False
    )
    gap = (
        activation_memory(LLAMA_8B, everything, longest).peak
        - activation_memory(LLAMA_8B, without_flash, longest).peak
    )
    assert gap == 28 * 1024 * longest


def test_two_level_halves_the_pinned_memory_and_moves_the_host_limit():
    """Llama-3.1-8B LoRA with every feature on, an H100's memory: 512K tokens of offloaded layer inputs
    take 128 GiB of pinned host memory (32 layers x 8 KiB per token), 64 GiB with two-level
    checkpointing (16 layers). The host limit is 90% of the node's RAM over 8 KiB per token per
    offloaded layer; the longest sequence is the lesser of the two limits and names it."""
    from cptune.parallel.memory import Longest, longest_within

    budget = H100_USABLE - lora_states()
    plain = ActivationSetup(True, True, offload=True, tiled_mlp=True, head_loss=True)
    two_level = ActivationSetup(True, True, offload=True, two_level=True, tiled_mlp=True, head_loss=True)
    tokens = 512 * 1024
    assert activation_memory(LLAMA_8B, plain, tokens).host == 128 * GiB
    assert activation_memory(LLAMA_8B, two_level, tokens).host == 64 * GiB
    # The regenerating forward (the layer before, keeping nothing) is not what sets the peak.
    phases = activation_memory(LLAMA_8B, two_level, tokens).phases
    assert phases["regeneration"] < phases["layer backward"]
    gpu_tokens = longest_tokens(LLAMA_8B, plain, budget)
    assert longest_tokens(LLAMA_8B, two_level, budget) == gpu_tokens  # the device keeps the same rows
    for host_gib in (125, 64):
        pinnable = 0.9 * host_gib * GiB
        for setup, layers in ((plain, 32), (two_level, 16)):
            host_tokens = int(pinnable // (layers * 4096 * 2)) // 1024 * 1024
            got = longest_within(LLAMA_8B, setup, budget, pinnable)
            assert (got.gpu_tokens, got.host_tokens) == (gpu_tokens, host_tokens)
            assert got.tokens == min(gpu_tokens, host_tokens)
            assert got.limit == ("host RAM" if host_tokens < gpu_tokens else "GPU memory")
    # A 64 GiB host binds plain offloading below the GPU's limit; two-level gives it back to the GPU.
    assert longest_within(LLAMA_8B, plain, budget, 0.9 * 64 * GiB).limit == "host RAM"
    assert longest_within(LLAMA_8B, two_level, budget, 0.9 * 64 * GiB).limit == "GPU memory"
    # Without offloading, or without a known host, only the GPU binds.
    unbounded = Longest(gpu_tokens, "GPU memory", gpu_tokens, None)
    assert longest_within(LLAMA_8B, two_level, budget, None) == unbounded


def test_context_parallel_buffers_grow_with_the_whole_sequence():
    """ring-flash-attn gathers K/V of the whole sequence: per-rank cost per token grows with cp."""
    from cptune.run.memory_plan import default_attention_buffers

    def cp8(backend: str) -> ActivationSetup:  # heads_k_stride 1, allgather
        return ActivationSetup(True, True, cp_size=8, attention_buffers=default_attention_buffers(backend))

    one = ActivationSetup(True, True, cp_size=1)
    eight, torch_cp = cp8("ring-flash-attn"), cp8("torch")
    tokens = 16384
    ring_extra = (
        activation_memory(LLAMA_8B, eight, tokens).phases["layer backward"]
        - activation_memory(LLAMA_8B, one, tokens).phases["layer backward"]
    )
    assert ring_extra == 2 * (2 * 2 * 8 * 1 * 128 * 2) * tokens  # double buffers of 1 KV head, fwd and bwd
    assert (
        activation_memory(LLAMA_8B, torch_cp, tokens).peak >= activation_memory(LLAMA_8B, eight, tokens).peak
    )


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_reference_forward_keeps_one_layer_input_and_never_sets_the_peak(lora):
    """rl's reference forward (no gradients) over the micro batch's tokens: the training forward, or the loss, less
    the checkpoints of the other 31 layers (it keeps none, only the running layer's input)."""
    from dataclasses import replace

    from cptune.parallel.memory import no_grad_forward_memory

    tokens = 16384
    for training in (
        ActivationSetup(mixed_precision=True, lora=lora),
        ActivationSetup(mixed_precision=True, lora=lora, head_loss=True, tiled_mlp=True, cp_size=1),
    ):
        step = activation_memory(LLAMA_8B, replace(training, reference_forward=True), tokens)
        alone = activation_memory(LLAMA_8B, training, tokens)
        other_checkpoints = (32 - 1) * 4096 * 2 * tokens  # layers' inputs in bf16
        forward = alone.phases["forward"]
        if training.tiled_mlp and not lora:
            # The training forward's tile holds the MLP weights' gradients (summed over tiles); no gradients here.
            forward -= 2 * 3 * 4096 * 14336 * 2
        # The loss's working set is the training loss's (an upper bound: no gradients are held without them).
        by_hand = max(forward, alone.phases["loss"]) - other_checkpoints
        # Float64 rounding only: the same few terms summed in another order (values near 1e10, eps 2.2e-16).
        assert step.phases["reference forward"] == pytest.approx(by_hand, rel=1e-12)
        assert no_grad_forward_memory(LLAMA_8B, training, tokens) == step.phases["reference forward"]
        # It keeps nothing, so the step's peak is the training step's.
        assert (step.peak, step.phase) == (alone.peak, alone.phase)


def test_mlp_tiles():
    assert mlp_tiles(16384, 4096) == 4  # ALST's default: ceil(tokens / hidden)
    assert mlp_tiles(100, 4096) == 1
    assert mlp_tiles(10, 64, num_shards=32) == 10  # never more tiles than tokens


# --- against CPU traces of tiny models ---------------------------------------------------------

TOKENS = 2048


def traced_peak(config: dict, mixed: bool, lora: bool, features: tuple[str, ...], chunk: int) -> int:
    """The activation peak of one training step (forward + backward), above the state before it.

    As the memory model's traces run it (benchmarks/memory_traces.py): one CPU thread (torch's CPU attention
    backward keeps buffers per thread that grow with the tokens: 0.8 MB more here at 2 threads), and for bf16
    LoRA cptune's lora-input-kept-under-autocast patch, which ``cptune train`` applies."""
    import contextlib
    from types import SimpleNamespace

    from benchmarks.memtrace import AllocationTrace
    from peft import LoraConfig, get_peft_model

    from cptune.models.head_loss import HeadLoss
    from cptune.models.offload import enable_activation_offloading
    from cptune.models.tiled_mlp import enable_tiled_mlp
    from cptune.parallel.loss import token_loss_sum
    from cptune.patches.core import PatchSet
    from cptune.patches.peft_patches import lora_input_cast_patch
    from devtools.tiny import build_tiny_model, tiny_llama_config

    model = build_tiny_model(tiny_llama_config(**config), seed=0)
    if mixed:
        model.to(torch.bfloat16)
    model.config.use_cache = False
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        model.enable_input_require_grads()
    if mixed:  # what accelerate does for bf16: autocast, and the model's outputs in fp32
        from accelerate.utils import convert_outputs_to_fp32

        forward = model.forward

        def autocast_forward(*args, **kwargs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return forward(*args, **kwargs)

        model.forward = convert_outputs_to_fp32(autocast_forward)
    if "offload" in features:
        enable_activation_offloading(model, two_level="two_level" in features)
    if "tiled" in features:
        enable_tiled_mlp(model, None)
    head_loss = HeadLoss(model, chunk) if "head" in features else None
    ids = torch.randint(5, config["vocab_size"], (1, TOKENS), generator=torch.Generator().manual_seed(0))
    kwargs, labels = {"input_ids": ids, "position_ids": torch.arange(TOKENS)[None]}, ids.roll(-1, 1)

    def step() -> None:
        if head_loss is not None:
            loss = head_loss(model, kwargs, labels)[0]
        else:
            loss = token_loss_sum(model(**kwargs, use_cache=False).logits, labels, chunk)
        loss.backward()

    recipe = SimpleNamespace(adapter="lora", bf16=True, fp16=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (
            PatchSet([lora_input_cast_patch()]).applied(recipe)
            if lora and mixed
            else contextlib.nullcontext()
        ):
            step()  # the gradients exist from here on: the traced step measures activations only
            with AllocationTrace() as trace:
                step()
    finally:
        torch.set_num_threads(threads)
    return trace.result.peak


MLP_HEAVY = {"vocab_size": 128, "intermediate_size": 512, "num_hidden_layers": 3}


@pytest.mark.parametrize(
    ("config", "mixed", "lora", "features"),
    [
        ({"vocab_size": 768}, False, True, ()),
        ({"vocab_size": 768}, True, True, ("offload", "tiled", "head")),
        (MLP_HEAVY, False, False, ()),
        (MLP_HEAVY, False, True, ("offload", "tiled")),
        (MLP_HEAVY, True, True, ("offload", "two_level", "tiled", "head")),
    ],
    ids=[
        "fp32-lora",
        "bf16-lora-all-features",
        "mlp-heavy-fp32-full",
        "mlp-heavy-fp32-lora-offload-tiled",
        "mlp-heavy-bf16-lora-all-features-two-level",
    ],
)
def test_predicted_peak_matches_the_cpu_trace(config, mixed, lora, features):
    """Loss chunks of 512 tokens, the share of a sequence 2^26 logits are for Llama 3's vocabulary."""
    chunk = 512 * config["vocab_size"]
    measured = traced_peak(config, mixed, lora, features, chunk)
    shape = ModelShape(
        layers=config.get("num_hidden_layers", 2),
        hidden=64,
        intermediate=config.get("intermediate_size", 256),
        heads=4,
        kv_heads=2,
        head_dim=16,
        vocab=config["vocab_size"],
    )
    setup = ActivationSetup(
        mixed_precision=mixed,
        lora=lora,
        offload="offload" in features,
        two_level="two_level" in features,
        tiled_mlp="tiled" in features,
        head_loss="head" in features,
        loss_chunk_elements=chunk,
        flash_attention=False,  # a CPU trace: no FlashAttention-2 backward buffers
    )
    predicted = activation_memory(shape, setup, TOKENS).peak
    assert abs(predicted - measured) <= 0.15 * measured, (predicted / measured, predicted, measured)
