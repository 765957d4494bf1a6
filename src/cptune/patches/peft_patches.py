"""Patches of peft 0.21.

Each function returns one :class:`~cptune.patches.core.Patch`; nothing is patched until a
:class:`~cptune.patches.core.PatchSet` applies it. This module imports nothing from peft.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cptune import versions
from cptune.patches.core import Patch

# Dtypes that hold every value of a half-precision input exactly: a cast there and back changes nothing.
_EXACT_WIDER = ("float32", "float64")


class LoraUnderAutocast:
    """Predicate: a LoRA (or QLoRA) adapter trained in mixed precision (``bf16``/``fp16``), where the forward runs
    under autocast with the adapter's weights in fp32."""

    def __call__(self, recipe: Any) -> bool:
        if recipe is None or getattr(recipe, "adapter", None) not in ("lora", "qlora"):
            return False
        return getattr(recipe, "bf16", False) in (True, "auto") or bool(getattr(recipe, "fp16", False))

    def __str__(self) -> str:
        return "adapter: lora or qlora with bf16 or fp16"


def _keeps_input_under_autocast(original: Callable[..., Any]) -> Callable[..., Any]:
    def _cast_input_dtype(self: Any, x: Any, dtype: Any) -> Any:
        if x is not None and _autocast_undoes(self, x, dtype):
            return x
        return original(self, x, dtype)

    return _cast_input_dtype


def _autocast_undoes(layer: Any, x: Any, dtype: Any) -> bool:
    """Whether autocast casts ``x.to(dtype)`` straight back to ``x``'s values before the layer's LoRA uses it.

    True for a plain LoRA linear layer (no variant such as DoRA, no dropout, whose arithmetic would
    run in the other dtype) whose input is in autocast's dtype while autocast is on for its device,
    and ``dtype`` holds that input exactly: the cast to ``dtype`` and autocast's cast back give the
    very same tensor values.
    """
    import torch
    from peft.tuners.lora.layer import Linear

    device = x.device.type
    if not (type(layer) is Linear and torch.is_autocast_enabled(device)):
        return False
    if x.dtype != torch.get_autocast_dtype(device) or str(dtype).removeprefix("torch.") not in _EXACT_WIDER:
        return False
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    return all(
        name not in layer.lora_variant and isinstance(layer.lora_dropout[name], torch.nn.Identity)
        for name in active
    )


def lora_input_cast_patch() -> Patch:
    """``BaseTunerLayer._cast_input_dtype`` → keep a LoRA linear layer's input as it is where autocast would undo the cast.

    peft casts each LoRA layer's input to its adapter's dtype (fp32) before ``lora_A``
    (peft/tuners/lora/layer.py:1100, ``Linear.forward``). Under bf16 autocast ``lora_A`` then casts
    it back to bf16 and saves that copy for its weight gradient: every LoRA projection of a layer
    keeps a bf16 copy of its input (q, k and v three of the same tensor), and an fp32 one exists
    on the way. Skipping the cast where autocast undoes it exactly gives ``lora_A`` the input
    itself, saved once for all the projections that share it, and the same values in forward and
    backward (tests/patches/test_peft_patches.py).
    """
    return Patch(
        name="lora-input-kept-under-autocast",
        target="peft.tuners.tuners_utils:BaseTunerLayer._cast_input_dtype",
        replacement=_keeps_input_under_autocast,
        reason=(
            "Under autocast a LoRA layer's input need not go to fp32 and back: each projection kept its own copy.\n"
            "peft/tuners/lora/layer.py:1100 casts the input to lora_A's dtype (fp32); autocast casts it back to "
            "bf16 in lora_A, which saves that copy; where the round trip is exact the input is passed as it is."
        ),
        remove_when=(
            "peft skips the input cast under autocast itself, or cptune fuses the LoRA projections that share "
            "an input."
        ),
        requires=versions.written_for("peft"),
        signature=("self", "x", "dtype"),
        applies_to=LoraUnderAutocast(),
    )
