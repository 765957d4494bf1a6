"""Parameter counts of the recipe's model, from its config alone (no weights are read).

The model is built on PyTorch's ``meta`` device, which allocates no memory, and
wrapped in the recipe's LoRA adapter (or partly frozen as its ``unfrozen_parameters``
say), so the counts are exactly those of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cptune.config.recipe import Recipe
from cptune.models.expert_quantization import is_expert_weight, parametrize_like_packed
from cptune.models.freezing import apply_unfrozen_parameters
from cptune.models.loading import apply_lora, meta_model, torch_dtype
from cptune.parallel.memory import ModelShape


@dataclass(frozen=True)
class ParameterCounts:
    """What the memory estimate needs to know about the model."""

    total: int
    trainable: int
    trainable_shapes: tuple[tuple[int, ...], ...]
    #: parameters of the largest decoder layer (FSDP2 gathers one layer at a time)
    largest_layer: int
    dtype_bytes: int
    #: frozen weights stored quantized: the linear layers bitsandbytes quantizes (load_in_4bit/8bit; 0
    #: otherwise), and with quantize_moe_experts the experts' 3D tensors
    quantized: int = 0
    #: parameters of all decoder layers (the rest, embeddings and head, is FSDP2's root unit)
    all_layers: int = 0
    #: frozen weights that stay in the training dtype although the recipe quantizes: a mixture of experts'
    #: expert tensors (3D, ``experts x out x in``), which bitsandbytes, quantizing linear layers only, leaves be
    #: unless the recipe sets quantize_moe_experts
    unquantized_experts: int = 0
    #: with quantize_moe_experts, the expert tensors' weights (among ``quantized``), packed once the model is loaded
    quantized_experts: int = 0


def count_parameters(recipe: Recipe, config: object) -> ParameterCounts:
    """Parameter counts of ``recipe``'s model (``config`` is its transformers config)."""
    model = meta_model(recipe, config)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layer_sizes = [
        sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in layer_classes
    ]
    largest_layer = max(layer_sizes, default=0)
    quantized = unquantized_experts = quantized_experts = 0
    if recipe.is_quantized:
        # What transformers hands to bitsandbytes: every linear layer but the output head and the
        # modules the recipe keeps (bnb_config_kwargs.llm_int8_skip_modules).
        skip = (
            set(recipe.bnb_config_kwargs.llm_int8_skip_modules or ()) if recipe.bnb_config_kwargs else set()
        )
        head = model.get_output_embeddings()
        quantized = sum(
            m.weight.numel()
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head and name.rsplit(".", 1)[-1] not in skip
        )
        experts = sum(p.numel() for name, p in model.named_parameters() if is_expert_weight(name, p))
        if recipe.quantize_moe_experts and recipe.load_in_4bit:
            quantized += experts
            quantized_experts = experts
        else:
            unquantized_experts = experts
    if quantized_experts:
        parametrize_like_packed(model)  # the packed experts take no adapter
    if recipe.is_lora:
        model = apply_lora(model, recipe, load_weights=False)
    apply_unfrozen_parameters(model, recipe)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ParameterCounts(
        total=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for p in trainable),
        trainable_shapes=tuple(tuple(p.shape) for p in trainable),
        largest_layer=largest_layer,
        all_layers=sum(layer_sizes),
        dtype_bytes=torch.tensor([], dtype=torch_dtype(recipe)).element_size(),
        quantized=quantized,
        unquantized_experts=unquantized_experts,
        quantized_experts=quantized_experts,
    )


def model_shape(config: Any) -> ModelShape | None:
    """The widths the activation estimate needs, from a decoder-only config; None when it lacks one."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        heads = int(text.num_attention_heads)
        hidden = int(text.hidden_size)
        return ModelShape(
            layers=int(text.num_hidden_layers),
            hidden=hidden,
            intermediate=mlp_width(text),
            heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            vocab=int(text.vocab_size),
        )
    except (AttributeError, TypeError, ValueError):
        return None


def mlp_width(text: Any) -> int:
    """The MLP intermediates' width per token: the dense width, or a mixture of experts' routed one.

    A routed token runs through ``num_experts_per_tok`` experts, each making the intermediates of
    one expert's width (``moe_intermediate_size`` for Qwen2/3-MoE, ``intermediate_size`` for Mixtral
    and gpt-oss), plus a shared expert's (Qwen2-MoE). With dense layers beside the sparse ones
    (``mlp_only_layers``, ``decoder_sparse_step``) the wider of the two bounds a layer. Not counted:
    the router's logits and the routed copies of the hidden states, of hidden-state order per token.
    """
    dense = int(text.intermediate_size)
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not experts or not top_k:
        return dense
    expert = int(getattr(text, "moe_intermediate_size", None) or dense)
    routed = int(top_k) * expert + int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
    has_dense = (
        bool(getattr(text, "mlp_only_layers", None)) or int(getattr(text, "decoder_sparse_step", 1) or 1) > 1
    )
    return max(dense, routed) if has_dense else routed
