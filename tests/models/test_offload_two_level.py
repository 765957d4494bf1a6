"""Two-level checkpointing (``activation_offloading: two_level``) against plain activation offloading.

The tiny Llama of tests/models/test_memory_features.py with 4 decoder layers (and 3, where the last
layer has no partner), fp32 and bf16 under autocast (as accelerate runs a bf16 recipe), LoRA with
dropout 0.1 on every linear layer and a full fine-tune. Two-level checkpointing keeps the inputs
of layers 0 and 2 in host memory and makes those of layers 1 and 3 again in the backward, by
running layers 0 and 2 once more under the RNG state their forward ran with. Nothing is summed in
another order, so the losses and every gradient are bit for bit those of plain offloading
(torch.equal), which is itself bit for bit the run without offloading (test_memory_features.py).
LoRA dropout draws a new mask at every forward: a regenerated input without the forward's RNG
state would differ, and so would every gradient of the layers below it
(``test_the_dropout_test_sees_a_wrong_rng_state`` shows the comparison catches that).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cptune.models import offload
from cptune.models.head_loss import HeadLoss
from cptune.models.offload import enable_activation_offloading
from cptune.models.tiled_mlp import enable_tiled_mlp
from tests.models.test_memory_features import TOKENS, step
from tests.models.test_memory_features import build as build_model

BF16 = torch.bfloat16
HIDDEN = 64  # tiny_llama_config's hidden size
LAYERS = 4


def build(lora: bool, bf16: bool, layers: int = LAYERS) -> torch.nn.Module:
    """The tiny Llama with ``layers`` layers, checkpointed; LoRA with dropout; bf16 under autocast or fp32."""
    model = build_model(False, dtype=BF16 if bf16 else None, num_hidden_layers=layers)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)
        config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear", init_lora_weights=False
        )
        model = get_peft_model(model, config)
    if bf16:  # what accelerate's prepare_model does for mixed_precision bf16: only the forward is autocast
        model.forward = torch.autocast("cpu", dtype=BF16)(model.forward)
    return model


def offloaded_step(lora: bool, bf16: bool, two_level: bool, layers: int = LAYERS, seed: int = 3):
    """(loss, gradients, offload stats) of one step with the dropout RNG seeded the same way."""
    model = build(lora, bf16, layers)
    offloader = enable_activation_offloading(model, two_level=two_level)
    torch.manual_seed(seed)
    loss, grads = step(model)
    return loss, grads, offloader.stats


def assert_bit_identical(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    differ = [name for name, grad in want[1].items() if not torch.equal(got[1][name], grad)]
    assert not differ, f"not bit-identical: {differ}"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora-dropout", "full"])
def test_two_level_is_bit_identical_to_plain_offloading(lora, bf16):
    plain = offloaded_step(lora, bf16, two_level=False)
    two_level = offloaded_step(lora, bf16, two_level=True)
    assert_bit_identical(two_level, plain)
    # Layers 1 and 3 were made again in the backward, from the inputs of layers 0 and 2.
    assert (two_level[2].regenerated, plain[2].regenerated) == (2, 0)
    assert two_level[2].packed == plain[2].packed == LAYERS


def test_two_level_holds_half_the_host_memory():
    """Pinned (here: numpy) host bytes: the inputs of 2 of 4 layers, 2 of 3 with an odd count."""
    row_bytes = 2 * TOKENS * HIDDEN * 2  # a layer input: 2 rows x TOKENS tokens x hidden in bf16
    for layers, offloaded in ((4, 2), (3, 2)):
        plain = offloaded_step(True, True, two_level=False, layers=layers)[2]
        two_level = offloaded_step(True, True, two_level=True, layers=layers)[2]
        assert plain.peak_host_bytes == layers * row_bytes
        assert two_level.peak_host_bytes == offloaded * row_bytes
        assert two_level.regenerated == layers - offloaded
        assert two_level.host_bytes == plain.host_bytes == 0  # all released after the backward


def test_two_level_with_every_memory_feature_in_bf16():
    """With the tiled MLP and the chunked loss as well, the regenerating forward runs the tiles too."""

    def run(two_level: bool):
        model = build(True, True)
        offloader = enable_activation_offloading(model, two_level=two_level)
        enable_tiled_mlp(model, num_shards=2)
        torch.manual_seed(3)
        return (*step(model, HeadLoss(model, chunk_elements=8 * 97)), offloader.stats)

    plain, two_level = run(False), run(True)
    assert_bit_identical(two_level, plain)
    assert two_level[2].regenerated == 2


def test_the_dropout_test_sees_a_wrong_rng_state(monkeypatch):
    """Regenerating under another RNG state than the forward's changes the gradients: the comparison of
    ``test_two_level_is_bit_identical_to_plain_offloading`` would catch a replay that went wrong."""
    plain = offloaded_step(True, False, two_level=False)
    capture = offload._Replay.capture

    def wrong_state(function, tensor):
        replay = capture(function, tensor)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(12345)
            return dataclasses.replace(replay, cpu_rng=torch.get_rng_state())

    monkeypatch.setattr(offload._Replay, "capture", staticmethod(wrong_state))
    wrong = offloaded_step(True, False, two_level=True)
    assert torch.equal(wrong[0], plain[0])  # the forward itself is untouched
    assert any(not torch.equal(wrong[1][name], grad) for name, grad in plain[1].items())


def test_two_level_offloads_a_layer_whose_input_is_not_the_layer_before():
    """Only an input that is the previous checkpointed call's output is regenerated."""
    offloader = offload.ActivationOffloader(use_streams=False, two_level=True)
    linear = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    first = offloader(linear, x)
    offloader(linear, first * 2)  # something between the two calls: not the first call's output
    assert offloader.stats.regenerated == 0
    third = offloader(linear, offloader(linear, x))
    third.sum().backward()
    assert offloader.stats.regenerated == 1
