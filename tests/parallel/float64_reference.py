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
    return twin.double()


def _dequantized_linear(layer: torch.nn.Module) -> torch.nn.Linear:
    import bitsandbytes as bnb

    weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight.reshape(layer.out_features, layer.in_features))
        if layer.bias is not None:
            linear.bias.copy_(layer.bias)
    return linear.requires_grad_(False)
