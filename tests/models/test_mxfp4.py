"""A gpt-oss checkpoint stored in MXFP4, loaded dequantized for training (model_quantization_config).

The checkpoint is written here, in the layout transformers 5.23 reads (integrations/mxfp4.py,
``_convert_moe_packed_tensors``): each expert tensor ``experts.<proj>`` of ``GptOssExperts``
(``experts x in x out``) is stored transposed, ``experts x out x in``, as

- ``<proj>_blocks``: uint8, ``experts x out x in/32 x 16``, two FP4 (E2M1) codes a byte, the even
  position's code in the low nibble, the odd position's in the high nibble;
- ``<proj>_scales``: uint8, ``experts x out x in/32``, one E8M0 scale a group of 32 values, the
  power-of-two exponent plus 127;

and config.json's ``quantization_config`` says ``quant_method: mxfp4``. The expert weights are chosen
so that MXFP4 holds them exactly (an FP4 value times a power of two per group), so the dequantized
weights must equal them bit for bit.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cptune.config.loader import validate_recipe
from cptune.errors import RecipeError
from cptune.models.loading import load_model, model_config
from cptune.models.sizing import count_parameters
from devtools.tiny import build_tiny_gpt_oss

VOCAB = 96
GROUP = 32  # values that share one scale
SCALE_BIAS = 127  # E8M0: the stored byte is the exponent plus 127
# FP4 E2M1 by its 4-bit code: the sign is the high bit, the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4 = torch.tensor(FP4_MAGNITUDES + tuple(-m for m in FP4_MAGNITUDES))
PROJECTIONS = ("gate_up_proj", "down_proj")
DEQUANTIZE = {
    "model_quantization_config": "Mxfp4Config",
    "model_quantization_config_kwargs": {"dequantize": True},
}


def exact_expert_weight(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Weights ``experts x in x out`` that MXFP4 represents exactly, in float32.

    Every group of 32 along ``in`` is random FP4 values (both zeros included) times 2**e, e from -9 to
    -4, with one value of magnitude 6 so that the group's largest magnitude fixes e.
    """
    experts, width, out = shape
    groups = width // GROUP
    codes = torch.randint(0, 16, (experts, out, groups, GROUP), generator=generator)
    codes[..., 0] = torch.where(torch.rand(experts, out, groups, generator=generator) < 0.5, 7, 15)  # +-6
    exponents = torch.randint(-9, -3, (experts, out, groups, 1), generator=generator)
    values = torch.ldexp(FP4[codes], exponents.float())
    return values.reshape(experts, out, width).transpose(1, 2).contiguous()


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of an ``experts x in x out`` weight that MXFP4 holds exactly.

    A group's exponent is the one that puts its largest magnitude between 4 and 8 (FP4's largest
    binade); a value that is not then an FP4 value fails.
    """
    experts, width, out = weight.shape
    groups = weight.transpose(1, 2).reshape(experts, out, width // GROUP, GROUP)
    largest = groups.abs().amax(dim=-1, keepdim=True)
    exponents = torch.floor(torch.log2(largest)) - 2
    scaled = torch.ldexp(groups, -exponents)
    magnitudes = torch.tensor(FP4_MAGNITUDES)
    matches = scaled.abs().unsqueeze(-1) == magnitudes
    assert matches.any(dim=-1).all(), "a value MXFP4 does not hold exactly"
    codes = matches.int().argmax(dim=-1) + 8 * torch.signbit(scaled).int()
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.to(torch.uint8), (exponents.squeeze(-1) + SCALE_BIAS).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny gpt-oss saved with its experts in MXFP4, and the same model built directly (float32)."""
    model = build_tiny_gpt_oss(VOCAB, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for name in PROJECTIONS:
                weight = getattr(layer.mlp.experts, name)
                weight.copy_(exact_expert_weight(weight.shape, generator))
    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model.config.save_pretrained(folder)
    tensors = {}
    for key, value in model.state_dict().items():
        name = key.rsplit(".", 1)[-1]
        if name in PROJECTIONS:
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = encode_mxfp4(value)
        else:
            tensors[key] = value.to(torch.bfloat16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    # As gpt-oss's own checkpoints have it: only the experts are in MXFP4.
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder, model


def recipe(folder: Path, **keys):
    return validate_recipe(
        {"base_model": str(folder), "datasets": [{"path": "d.jsonl"}], "bf16": True, **keys}
    )


def test_the_encoder_writes_the_layout_transformers_decodes(mxfp4_checkpoint):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, model = mxfp4_checkpoint
    weight = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    blocks, scales = encode_mxfp4(weight)
    assert blocks.shape == (4, 64, 2, 16) and scales.shape == (4, 64, 2)
    decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(decoded.view(torch.int16), weight.to(torch.bfloat16).view(torch.int16))


def test_an_mxfp4_checkpoint_loads_dequantized_bit_for_bit(mxfp4_checkpoint, monkeypatch):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    # On a CPU transformers dequantizes an MXFP4 checkpoint even unasked (it has no MXFP4 kernels there,
    # quantizers/quantizer_mxfp4.py); on a GPU with triton and kernels it keeps MXFP4 unless told not to.
    # So what cptune asks for is checked too.
    asked = []
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        asked.append(kwargs.get("quantization_config"))
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    folder, model = mxfp4_checkpoint
    loaded = load_model(recipe(folder, **DEQUANTIZE), None)
    (config,) = asked
    assert isinstance(config, Mxfp4Config) and config.dequantize is True
    for built, read in zip(model.model.layers, loaded.model.layers, strict=True):
        for name in PROJECTIONS:
            expected = getattr(built.mlp.experts, name).detach().to(torch.bfloat16)
            got = getattr(read.mlp.experts, name)
            assert got.dtype == torch.bfloat16 and got.requires_grad
            assert torch.equal(got.detach().view(torch.int16), expected.view(torch.int16)), name
    # Loaded dequantized, the model is a plain bf16 one: no quantizer, nothing that says MXFP4 when saved.
    assert not getattr(loaded, "hf_quantizer", None) and not hasattr(loaded.config, "quantization_config")

    # The same model built directly: its weights in bf16, as from_pretrained(dtype=bf16) makes them; its
    # buffers (RoPE's inverse frequencies) stay float32, as from_pretrained keeps them.
    direct = copy.deepcopy(model).eval()
    for parameter in direct.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    direct.set_attn_implementation(loaded.config._attn_implementation)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, direct(ids).logits)


def test_the_dequantized_model_saves_and_loads_again_as_a_plain_one(mxfp4_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, model = mxfp4_checkpoint
    loaded = load_model(recipe(folder, **DEQUANTIZE), None)
    loaded.save_pretrained(tmp_path)
    names = {n for n in load_file(tmp_path / "model.safetensors") if ".experts." in n}
    assert names == {
        f"model.layers.{i}.mlp.experts.{p}{s}" for i in (0, 1) for p in PROJECTIONS for s in ("", "_bias")
    }
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for built, read in zip(model.model.layers, again.model.layers, strict=True):
        for name in PROJECTIONS:
            expected = getattr(built.mlp.experts, name).detach().to(torch.bfloat16)
            assert torch.equal(
                getattr(read.mlp.experts, name).detach().view(torch.int16), expected.view(torch.int16)
            )


def test_the_memory_plan_counts_the_dequantized_model(mxfp4_checkpoint):
    folder, model = mxfp4_checkpoint
    dequantized = recipe(folder, **DEQUANTIZE)
    counts = count_parameters(dequantized, model_config(dequantized))
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert (counts.dtype_bytes, counts.quantized, counts.unquantized_experts) == (2, 0, 0)


def problems(**keys) -> str:
    with pytest.raises(RecipeError) as caught:
        validate_recipe({"base_model": "m", "datasets": [{"path": "d.jsonl"}], **keys})
    return str(caught.value)


def test_training_in_mxfp4_is_refused():
    for kwargs in ({}, {"model_quantization_config_kwargs": {"dequantize": False}}):
        text = problems(model_quantization_config="Mxfp4Config", **kwargs)
        assert (
            "model_quantization_config_kwargs: model_quantization_config: Mxfp4Config keeps the weights in MXFP4 "
            "unless dequantize is true, and MXFP4 weights cannot be trained; set model_quantization_config_kwargs: "
            "{dequantize: true}" in text
        )
        assert "1 problem" in text


def test_other_quantization_configs_are_refused_naming_mxfp4():
    text = problems(model_quantization_config="FineGrainedFP8Config", model_quantization_config_kwargs={})
    assert (
        "model_quantization_config: cptune loads quantized checkpoints only with Mxfp4Config (gpt-oss's MXFP4 "
        "weights, dequantized for training), not 'FineGrainedFP8Config'." in text
    )
    assert "1 problem" in text  # its kwargs are not reported as set without it


def test_kwargs_need_the_config_and_one_quantization_at_a_time():
    text = problems(model_quantization_config_kwargs={"dequantize": True})
    assert "model_quantization_config: is not set, but model_quantization_config_kwargs is" in text
    text = problems(**DEQUANTIZE, adapter="qlora", load_in_4bit=True)
    assert "load_in_4bit: the base model is loaded with model_quantization_config: Mxfp4Config" in text
    assert "one quantization at a time" in text
    text = problems(**DEQUANTIZE, adapter="lora", load_in_8bit=True)
    assert "load_in_8bit: the base model is loaded with model_quantization_config: Mxfp4Config" in text


def test_mxfp4_options_are_kept():
    keys = {"model_quantization_config_kwargs": {"dequantize": True, "modules_to_not_convert": ["lm_head"]}}
    loaded = validate_recipe(
        {
            "base_model": "m",
            "datasets": [{"path": "d.jsonl"}],
            "model_quantization_config": "Mxfp4Config",
            **keys,
        }
    )
    from cptune.models.quantization import mxfp4_config

    config = mxfp4_config(loaded)
    assert config.dequantize is True and config.modules_to_not_convert == ["lm_head"]
    assert config.quant_method == "mxfp4"
