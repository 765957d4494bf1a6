"""QLoRA for a mixture of experts: the experts' 3D weight tensors stored in 4 bits (``quantize_moe_experts``).

bitsandbytes quantizes linear layers (transformers swaps ``nn.Linear`` for ``Linear4bit``), but
transformers 5 keeps a mixture of experts' weights as 3D parameters of one experts module
(``experts x out x in``, or transposed: Qwen3-MoE's and Mixtral's ``gate_up_proj`` and
``down_proj``, gpt-oss's beside their biases), which ``load_in_4bit`` leaves in the training dtype.
With ``quantize_moe_experts``, once the model is loaded, each such parameter is packed with
bitsandbytes' blockwise 4-bit quantization (the recipe's ``bnb_4bit_quant_type``, NF4 by default,
and double quantization unless ``bnb_4bit_use_double_quant: false``), and a torch parametrization
dequantizes it to the training dtype whenever the experts' forward reads it, whichever experts
implementation runs (``eager``, ``batched_mm``, ``grouped_mm``). The reads within one call of the
experts module share one dequantized copy (parametrize's cache, on for the call and cleared when it
returns), so the eager loop over the experts dequantizes each tensor once per call.

The backward: the ops keep the dequantized weights they multiplied with for their input gradient.
The recipe rules require gradient checkpointing with this key, so each decoder layer's checkpoint
drops those saved tensors in the forward, and its recomputation in the backward dequantizes the
layer's experts again: one layer's dequantized experts exist at a time. The experts stay frozen and
take no LoRA adapter (peft adapts parameters, and a parametrized tensor is none; without the key, peft
0.21 adapts transformers 5's fused expert tensors through ``target_parameters``, as Axolotl does only
with ``lora_target_parameters``, a key cptune lacks). LoRA adapters train on the other layers, and
gradients flow through the dequantized experts to them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from cptune.config.recipe import Recipe


def is_expert_weight(name: str, param: torch.Tensor) -> bool:
    """Whether a parameter (by its full name) is a weight tensor of a mixture of experts' experts module."""
    return param.dim() >= 3 and ".experts." in f".{name}"


def expert_weights(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(experts module, parameter name) for each expert weight tensor of ``model``, before quantization."""
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if is_expert_weight(f"{module_name}.{name}", param):
                yield module, name


class Dequantize4bit(nn.Module):
    """A parametrization: the packed 4-bit storage in, the weight in its original shape and dtype out."""

    def __init__(self, quant_state: Any) -> None:
        super().__init__()
        self.quant_state = quant_state

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        if self.quant_state.absmax.device != packed.device:
            self.quant_state.to(
                packed.device
            )  # the quantization constants are not buffers: follow the storage
        with torch.no_grad():  # the experts are frozen: nothing to differentiate through the unpacking
            return dequantize_4bit(packed, self.quant_state)


def _open_cache(module: nn.Module, args: Any) -> None:
    cache = parametrize.cached()
    cache.__enter__()
    module.__dict__["_cptune_dequantized_cache"] = cache


def _close_cache(module: nn.Module, args: Any, output: Any) -> None:
    # always_call: also when the forward stops early (a non-reentrant checkpoint's recomputation ends the
    # forward with an exception once it has what the backward needs), so the global cache never leaks.
    cache = module.__dict__.pop("_cptune_dequantized_cache", None)
    if cache is not None:
        cache.__exit__(None, None, None)


def quantize_experts(model: nn.Module, recipe: Recipe) -> int:
    """Pack every expert weight tensor of ``model`` into frozen 4-bit storage; returns how many weights it packed.

    Each tensor is quantized where it lies (bitsandbytes quantizes on the CPU and on GPUs), replaced by
    its packed bytes (a frozen ``uint8`` parameter under ``parametrizations.<name>.original``), and read
    through :class:`Dequantize4bit`.
    """
    from bitsandbytes.functional import quantize_4bit

    options = recipe.bnb_config_kwargs
    quant_type = options.bnb_4bit_quant_type if options else "nf4"
    double_quant = options.bnb_4bit_use_double_quant if options else True
    packed = 0
    cached: set[int] = set()
    for module, name in list(expert_weights(model)):
        weight = getattr(module, name)
        data, state = quantize_4bit(weight.data, compress_statistics=double_quant, quant_type=quant_type)
        packed += weight.numel()
        setattr(module, name, nn.Parameter(data, requires_grad=False))
        del weight
        parametrize.register_parametrization(module, name, Dequantize4bit(state), unsafe=True)
        if id(module) not in cached:
            cached.add(id(module))
            module.register_forward_pre_hook(_open_cache)
            module.register_forward_hook(_close_cache, always_call=True)
    return packed


class _Unpacked(nn.Module):
    """:class:`Dequantize4bit`'s stand-in on a model without weights: the tensor as it is."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight


def parametrize_like_packed(model: nn.Module) -> None:
    """Put a parametrization on each expert tensor of a weightless (meta) model, as :func:`quantize_experts` does.

    peft adapts a module's own parameters (``target_parameters``, which peft 0.21 fills in for the
    experts' fused tensors of transformers 5 when the recipe's targets name the MLP projections or
    all-linear), and a parametrized tensor is no longer one: the packed experts take no LoRA adapter. On
    a model shaped this way peft adapts what it adapts on the loaded one, so the sizes agree.
    """
    for module, name in list(expert_weights(model)):
        parametrize.register_parametrization(module, name, _Unpacked(), unsafe=True)


def dequantize_experts(model: nn.Module) -> int:
    """Replace each packed expert tensor by a plain parameter holding its dequantized values; returns how many.

    What the adapter saw in training, for merging it into the weights (``cptune merge-lora``).
    """
    count = 0
    for module in list(model.modules()):
        if not parametrize.is_parametrized(module):
            continue
        for name in list(module.parametrizations.keys()):
            if not isinstance(module.parametrizations[name][0], Dequantize4bit):
                continue
            value = getattr(module, name).detach().clone()
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)
            setattr(module, name, nn.Parameter(value, requires_grad=False))
            count += 1
    return count
