"""A base model quantized by bitsandbytes under a LoRA adapter: QLoRA (4-bit NF4) and LoRA on 8 bits.

Quantization goes through transformers' ``BitsAndBytesConfig`` with Axolotl's defaults (NF4, double
quantization). The 4-bit matmuls compute in the training dtype, and the packed weights are stored in
it too, as DeepSpeed and FSDP need. cptune does not call peft's ``prepare_model_for_kbit_training``:
it casts every weight that is not quantized (norms, embeddings, output head) to fp32, which for an
8B model is 2.1 GB more in bf16 runs and which Axolotl casts back afterwards; what else it does
(freezing the base, input gradients for checkpointing) cptune does when it applies the adapter.

A base stored in MXFP4 (gpt-oss's checkpoints) is not trained quantized: transformers' ``Mxfp4Config``
dequantizes its experts while loading (:func:`mxfp4_config`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from cptune.config.recipe import Recipe
from cptune.errors import BackendUnavailableError

INSTALL_HINT = "pip install 'cptune[quantization]' (bitsandbytes>=0.50)"

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "uint8": torch.uint8,
}


def check_bitsandbytes(recipe: Recipe) -> None:
    """Refuse a quantized base when bitsandbytes is not installed."""
    if recipe.is_quantized and importlib.util.find_spec("bitsandbytes") is None:
        key = "load_in_4bit" if recipe.load_in_4bit else "load_in_8bit"
        raise BackendUnavailableError(
            f"{key}: quantizing the base model needs bitsandbytes, which is not installed; {INSTALL_HINT}."
        )


def quantization_config(recipe: Recipe, dtype: torch.dtype) -> Any | None:
    """transformers' ``BitsAndBytesConfig`` for the recipe (None for a full-precision base)."""
    if not recipe.is_quantized:
        return None
    check_bitsandbytes(recipe)
    from transformers import BitsAndBytesConfig

    options = recipe.bnb_config_kwargs
    skip = list(options.llm_int8_skip_modules) if options and options.llm_int8_skip_modules else None
    if recipe.load_in_8bit:
        return BitsAndBytesConfig(
            load_in_8bit=True,
            llm_int8_threshold=options.llm_int8_threshold if options else 6.0,
            llm_int8_skip_modules=skip,
        )
    compute = _DTYPES[options.bnb_4bit_compute_dtype] if options and options.bnb_4bit_compute_dtype else dtype
    storage = _DTYPES[options.bnb_4bit_quant_storage] if options and options.bnb_4bit_quant_storage else dtype
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=options.bnb_4bit_quant_type if options else "nf4",
        bnb_4bit_use_double_quant=options.bnb_4bit_use_double_quant if options else True,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=storage,
        llm_int8_skip_modules=skip,
    )


def mxfp4_config(recipe: Recipe) -> Any | None:
    """transformers' ``Mxfp4Config`` for a base stored in MXFP4 (None for any other base).

    It dequantizes while loading: transformers reads each expert tensor's packed ``*_blocks`` and
    ``*_scales`` and builds the plain ``GptOssExperts`` weights in the training dtype; the loaded model
    carries no quantizer and trains like a full-precision one (and saves like one once
    :func:`save_dequantized_experts_as_plain` ran). The recipe rules make sure ``dequantize`` is true.
    """
    if not recipe.dequantizes_mxfp4:
        return None
    from transformers import Mxfp4Config

    options = recipe.model_quantization_config_kwargs
    skip = list(options.modules_to_not_convert) if options and options.modules_to_not_convert else None
    return Mxfp4Config(dequantize=True, modules_to_not_convert=skip)


def save_dequantized_experts_as_plain(model: Any) -> int:
    """Make ``save_pretrained`` write a dequantized MXFP4 model's experts under their own names; returns how
    many loading conversions it dropped.

    transformers 5.23 keeps the conversions that loaded a model (``model._weight_conversions``) and
    reverses them when saving (core_model_loading.py, ``revert_weight_conversion``). The reverse of the
    MXFP4 dequantization is the identity (``Mxfp4Dequantize.reverse_op``), so the reversed conversion
    writes the trained ``experts.gate_up_proj`` under its first checkpoint name, ``gate_up_proj_blocks``,
    in the training dtype and without scales: a checkpoint whose experts are missing when it is loaded
    again (transformers initialises them at random). The dequantized model is a plain one, so it drops
    those conversions and saves like one.
    """
    from transformers.integrations.mxfp4 import Mxfp4Dequantize

    conversions = getattr(model, "_weight_conversions", None) or []
    kept = [
        c
        for c in conversions
        if not any(isinstance(op, Mxfp4Dequantize) for op in getattr(c, "operations", ()))
    ]
    if len(kept) < len(conversions):
        model._weight_conversions = kept
    return len(conversions) - len(kept)


def device_map(recipe: Recipe, local_rank: int) -> dict[str, Any] | None:
    """Where each process puts its quantized copy: bitsandbytes quantizes when weights reach the device."""
    if not recipe.is_quantized or not torch.cuda.is_available():
        return None
    return {"": torch.device("cuda", local_rank)}


def keep_cpu_layers_differentiable(model: Any) -> int:
    """Stop bitsandbytes from switching a CPU model's 4-bit layers to its inference kernel; returns how many.

    bitsandbytes 0.50.2, on CPUs with AVX512-BF16, repacks a 4-bit layer's weights for a bf16
    inference kernel on the layer's first forward pass in eval mode without gradients (an
    evaluation), and uses that kernel from then on, also in training mode: its results are bf16
    (1e-2 off on the tiny model) and no gradient flows back through the layer, so every layer below
    it stops learning after the first evaluation. The layer's ``support_avx512bf16_for_cpu`` switch
    (bitsandbytes/nn/modules.py, Linear4bit.forward) turns the repacking off; evaluation then runs
    the same exact path as training.
    """
    switched = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            switched += 1
    return switched


def dequantize_in_place(model: Any) -> Any:
    """Replace the quantized layers by plain ones holding the dequantized weights (what the adapter saw).

    Must run before the model's first forward pass: on CPUs with AVX512-BF16, bitsandbytes 0.50
    repacks 4-bit weights for its inference kernel on the first no-grad forward, after which they no
    longer dequantize to the trained values. The experts packed by ``quantize_moe_experts`` become plain
    parameters the same way (:func:`cptune.models.expert_quantization.dequantize_experts`).
    """
    from cptune.models.expert_quantization import dequantize_experts

    dequantize_experts(model)
    return model.dequantize()
