"""The peft patch ``lora-input-kept-under-autocast``: the same bits, one saved input where each projection kept its own.

The tiny Llama in bf16 with fp32 LoRA adapters, the forward under bf16 autocast as accelerate runs
it (tests/models/test_memory_features_bf16.py), with and without the patch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cptune.models.head_loss import HeadLoss
from cptune.models.offload import enable_activation_offloading
from cptune.models.tiled_mlp import enable_tiled_mlp
from cptune.patches.core import PatchSet
from cptune.patches.peft_patches import LoraUnderAutocast, lora_input_cast_patch
from tests import reorder
from tests.models import test_memory_features as fp32_case
from tests.models.test_memory_features import TOKENS, batch, step
from tests.models.test_memory_features_bf16 import ROWS, build


class Recipe:
    adapter, bf16, fp16 = "lora", True, False


def patched(on: bool = True) -> contextlib.AbstractContextManager:
    return PatchSet([lora_input_cast_patch()]).applied(Recipe()) if on else contextlib.nullcontext()


def lora_a_inputs(model: torch.nn.Module) -> list[torch.dtype]:
    """The dtype each ``lora_A`` of the model receives, in call order (hooks stay on the model)."""
    seen: list[torch.dtype] = []
    for name, module in model.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda m, args, out: seen.append(args[0].dtype))
    return seen


@pytest.mark.parametrize("features", [False, True], ids=["plain", "all-memory-features"])
def test_the_patch_changes_no_bit(features):
    """Losses and every gradient bit for bit the same: the input cast to fp32 and back was exact."""

    def run(on: bool):
        model = build(lora=True)
        loss_fn = fp32_case.logits_loss
        if features:
            enable_activation_offloading(model)
            enable_tiled_mlp(model, num_shards=reorder.tiles(3))
            loss_fn = HeadLoss(model)
        dtypes = lora_a_inputs(model)
        with patched(on):
            result = step(model, loss_fn)
        return result, set(dtypes)

    (loss, grads), before = run(False)
    (patched_loss, patched_grads), after = run(True)
    assert before == {torch.float32} and after == {torch.bfloat16}  # the patch did act
    assert torch.equal(patched_loss, loss)
    differ = [n for n, g in grads.items() if not torch.equal(patched_grads[n], g)]
    assert not differ, f"not bit-identical: {differ}"


def test_a_decoder_layer_saves_each_shared_input_once():
    """Per token, one layer saves 4 fewer bf16 rows of its width (64): q, k and v one copy of their
    input instead of three, gate and up one instead of two, o the attention's own saved output."""

    def saved_bytes(on: bool) -> int:
        model = build(lora=True, checkpointing=False)
        layer = model.get_base_model().model.layers[0]
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        layer.register_forward_pre_hook(lambda module, args: hooks.__enter__())
        layer.register_forward_hook(lambda module, args, out: hooks.__exit__(None, None, None))
        kwargs, _ = batch()
        with patched(on):
            model(**kwargs)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(size for pointer, size in storages.items() if pointer not in weights)

    assert saved_bytes(False) - saved_bytes(True) == ROWS * TOKENS * 4 * 64 * 2


def test_the_cast_stays_where_autocast_would_not_undo_it():
    """Without autocast (fp32, or a bf16 base run without it) and with LoRA dropout, peft casts as before."""
    model = fp32_case.build(lora=True)  # fp32 throughout: the cast is a no-op, the patch need not act
    dtypes = lora_a_inputs(model)
    with patched():
        step(model)
    assert set(dtypes) == {torch.float32}
    model = build(lora=True)
    model.forward = model.forward.__wrapped__  # bf16 base, no autocast: lora_A needs its fp32 input
    dtypes = lora_a_inputs(model)
    with patched():
        step(model)
    assert set(dtypes) == {torch.float32}
    model = build(lora=True)
    for module in model.modules():
        if hasattr(module, "lora_dropout"):
            module.lora_dropout["default"] = torch.nn.Dropout(0.1)
    dtypes = lora_a_inputs(model)
    with patched():
        step(model)
    assert set(dtypes) == {torch.float32}


def test_the_patch_is_planned_for_lora_in_mixed_precision():
    class Recipe:
        def __init__(self, adapter, bf16=False, fp16=False):
            self.adapter, self.bf16, self.fp16 = adapter, bf16, fp16

    applies = LoraUnderAutocast()
    assert applies(Recipe("lora", bf16=True)) and applies(Recipe("qlora", bf16="auto"))
    assert applies(Recipe("lora", fp16=True))
    assert not applies(Recipe("lora")) and not applies(Recipe(None, bf16=True)) and not applies(None)
