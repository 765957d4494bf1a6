"""The parity workers' float64 reference: the cp=1 model, the same function computed in float64.

The fp32 parity tolerances follow the float64-reference rule of tests/numerics.py: a CP run may
land at most a few times as far from this model's results as the farthest of the fp32 cp=1 reference and
its fp32 reorder twins (tests/parallel/reorder_twins.py) does.
"""

from __future__ import annotations

import copy
import sys

import torch


def float64_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model``; 4-bit layers become plain linear layers of their dequantized weights.

    A bitsandbytes 4-bit layer computes ``x @ dequantize(W).T + b`` in fp32 on CPU
    (``keep_cpu_layers_differentiable``) and cannot run in float64: the copy computes that in float64.
    """
    twin = copy.deepcopy(model)
    bnb = sys.modules.get("bitsandbytes")  # only a model quantized by it has its layers
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if bnb is not None and isinstance(child, bnb.nn.Linear4bit):
                setattr(parent, name, _dequantized_linear(child))
    _dequantize_packed_experts_in_float64(twin)
    return twin.double()


class _InFloat64(torch.nn.Module):
    """A packed expert tensor's parametrization whose dequantized (fp32) values the twin reads in float64."""

    def __init__(self, dequantize: torch.nn.Module) -> None:
        super().__init__()
        self.dequantize = dequantize

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        return self.dequantize(packed).double()


def _dequantize_packed_experts_in_float64(twin: torch.nn.Module) -> None:
    """Expert tensors packed by quantize_moe_experts stay packed in the twin (uint8, untouched by ``double``)
    and are read in float64. Swapped inside their parametrization, not removed: torch removes a
    parametrization from the class a deep copy shares with the model it was copied from."""
    if "cptune.models.expert_quantization" not in sys.modules:
        return
    from cptune.models.expert_quantization import Dequantize4bit

    for module in twin.modules():
        for chain in getattr(module, "parametrizations", {}).values():
            if isinstance(chain[0], Dequantize4bit):
                chain[0] = _InFloat64(chain[0])


def _dequantized_linear(layer: torch.nn.Module) -> torch.nn.Linear:
    import bitsandbytes as bnb

    weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight.reshape(layer.out_features, layer.in_features))
        if layer.bias is not None:
            linear.bias.copy_(layer.bias)
    return linear.requires_grad_(False)
