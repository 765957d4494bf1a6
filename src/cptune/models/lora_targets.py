"""Every LoRA target a recipe names must adapt something: a module, or a mixture of experts' fused expert weights.

transformers 5 keeps a mixture of experts' expert weights as fused 3-D parameters (Qwen3-MoE's and
Mixtral's ``experts.gate_up_proj`` and ``experts.down_proj``), not as linear modules. peft 0.21
adapts them as parameters: ``lora_target_linear`` (``all-linear``) takes them with the attention
projections and the router, and a named target is carried over from the model's transformers 4
module names (Qwen3-MoE's ``gate_proj``/``up_proj``/``down_proj``, Mixtral's ``w1``/``w3``/``w2``,
peft's ``convert_peft_config_for_transformers``). peft refuses a list only when none of its names
matches, so ``[q_proj, down_proj]`` on Mixtral trains ``q_proj`` and silently leaves the experts
alone (``down_proj`` is no module there, nor one of its transformers 4 names): each name is checked
here on its own.
"""

from __future__ import annotations

import re
from typing import Any

from cptune.errors import CptuneError

EXPERT_HINT = (
    "A mixture of experts' expert weights are fused parameters in transformers 5, which peft adapts with "
    "lora_target_linear: true, or when named by the model's transformers 4 module names (Qwen3-MoE: "
    "gate_proj, up_proj, down_proj; Mixtral: w1, w3, w2)."
)
PACKED_EXPERTS_HINT = (
    "With quantize_moe_experts the experts' weights are packed in 4 bits and take no LoRA adapter (as in "
    "Axolotl, where only lora_target_parameters adapts them): remove the names that only the experts match, "
    "or remove quantize_moe_experts to adapt the experts in the training dtype."
)


def check_every_target_matched(
    peft_model: Any, targets: tuple[str, ...], packed_experts: bool = False
) -> None:
    """Refuse a named LoRA target that adapted no module and no parameter of ``peft_model``.

    Args:
        peft_model: The model with the adapter applied (a meta-device copy will do).
        targets: The recipe's ``lora_target_modules``.
        packed_experts: The recipe packs the experts (``quantize_moe_experts``), which then take no adapter.

    Raises:
        CptuneError: naming the targets that matched nothing.
    """
    tuner = peft_model.base_model
    config = next(iter(tuner.peft_config.values()))
    adapted = [*tuner.targeted_module_names, *getattr(tuner, "targeted_parameter_names", [])]
    # peft's conversion may have replaced a name (Mixtral's w2 -> the experts' down_proj parameter).
    converted = {*(config.target_modules or ()), *(getattr(config, "target_parameters", None) or ())}
    unmatched = [
        name
        for name in targets
        if name in converted and not any(key == name or key.endswith(f".{name}") for key in adapted)
    ]
    if unmatched:
        model_name = type(tuner.model).__name__
        raise CptuneError(
            f"lora_target_modules: {', '.join(repr(n) for n in unmatched)} adapts nothing in {model_name} "
            f"(the other targets do, so peft would train without it). "
            + (PACKED_EXPERTS_HINT if packed_experts else f"{EXPERT_HINT} Remove or rename it.")
        )


def check_supported_module(err: BaseException) -> None:
    """Turn peft's refusal of a module type it cannot adapt into one line (peft's own quotes the module's repr).

    Raises:
        CptuneError: ``err`` is that refusal; any other error is left to the caller.
    """
    found = re.match(r"Target module (\w+)\(", str(err).strip())
    if found is not None:
        raise CptuneError(
            f"lora_target_modules: peft cannot adapt a {found.group(1)} module (it adapts linear, embedding and "
            f"convolution layers). {EXPERT_HINT}"
        )
