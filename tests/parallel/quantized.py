"""The parity workers' tiny model with its linear layers in 4-bit NF4, quantized as cptune quantizes a QLoRA base."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_model


def quantized_4bit(
    model: torch.nn.Module, attn_implementation: str, experts: bool = False
) -> torch.nn.Module:
    """``model`` reloaded through bitsandbytes (every linear layer but the output head in 4 bits).

    ``experts``: a mixture of experts' expert tensors are packed in 4 bits too, as ``quantize_moe_experts``
    packs them. Quantizing is deterministic, so every rank (and the cp=1 reference) gets the same weights.
    """
    from transformers import AutoModelForCausalLM

    from cptune.config.loader import validate_recipe
    from cptune.models.expert_quantization import quantize_experts
    from cptune.models.quantization import keep_cpu_layers_differentiable, quantization_config

    qlora = validate_recipe(
        {
            "base_model": "tiny",
            "datasets": [{"path": "d.jsonl"}],
            "adapter": "qlora",
            "load_in_4bit": True,
            "gradient_checkpointing": True,
            "quantize_moe_experts": experts,
        }
    )
    experts_implementation = getattr(model.config, "_experts_implementation", None)
    with tempfile.TemporaryDirectory() as folder:
        # Written by hand: save_pretrained writes nothing on ranks other than 0 of a process group.
        model.config.to_json_file(Path(folder) / "config.json")
        save_model(model, str(Path(folder) / "model.safetensors"))
        quantized = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=quantization_config(qlora, torch.float32), dtype=torch.float32
        )
    keep_cpu_layers_differentiable(quantized)
    if experts:
        quantize_experts(quantized, qlora)
    if any(name.endswith(".experts") for name, _ in quantized.named_modules()):
        quantized.set_experts_implementation(experts_implementation)  # the config file does not keep it
    quantized.set_attn_implementation(attn_implementation)
    return quantized.train()
