"""Models with layers that carry a state from token to token (linear attention, Mamba, convolutions).

Packed samples are kept apart by position_ids restarting at each sample; transformers turns them into
attention masks, but runs the other layers over the whole row. cptune refuses sample packing for such
models instead of training every sample on the ones packed before it.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from cptune.config.loader import load_recipe
from cptune.errors import CptuneError
from cptune.parallel.backends.attention import stateful_layer_types
from cptune.run.plan import RunPlan

SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


def qwen3_5_config(vocab_size: int = 64) -> transformers.PretrainedConfig:
    """A two-layer Qwen3.5: one gated-delta-rule (linear attention) layer, then one full-attention layer."""
    return transformers.Qwen3_5TextConfig(
        **{**SMALL, "vocab_size": vocab_size},
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )


def test_transformers_carries_a_linear_attention_state_across_packed_samples():
    """Why packing is refused: the second sample of a packed row is not computed as it is alone.

    Its attention layer keeps the samples apart (without a cache, transformers turns position_ids that
    restart at 0 into a mask per sample: a Llama is exact here to fp32 rounding, about 1e-7); the
    linear-attention layer does not. The gap is the first sample's state (6e-3 for this seed), far above
    rounding; if transformers ever restarts these layers at each sample, this fails and the refusal can go."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(qwen3_5_config()).eval()
    first, second = torch.randint(0, 64, (1, 7)), torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        alone = model(input_ids=second, position_ids=torch.arange(5)[None], use_cache=False).logits
        packed_ids = torch.cat([first, second], 1)
        positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
        packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits[:, 7:]
    assert (packed - alone).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("config", "kinds"),
    [
        (qwen3_5_config(), ["linear_attention"]),
        (transformers.FalconH1Config(num_hidden_layers=2), ["hybrid"]),
        (transformers.Lfm2Config(num_hidden_layers=3, full_attn_idxs=[1]), ["conv"]),
        (transformers.NemotronHConfig(layers_block_type=["mamba", "attention", "mlp", "moe"]), None),
        (transformers.Gemma3TextConfig(num_hidden_layers=6), []),
        (transformers.Llama4TextConfig(num_hidden_layers=4), []),
        (transformers.LlamaConfig(num_hidden_layers=2), []),
    ],
    ids=["qwen3_5", "falcon_h1", "lfm2", "nemotron_h", "gemma3", "llama4", "llama"],
)
def test_stateful_layer_types_are_the_kinds_that_mix_tokens_other_than_by_attention(config, kinds):
    layer_types = getattr(config, "layer_types", None)
    if (
        kinds is None
    ):  # NemotronH: its Mamba layers count, its MLP and mixture-of-experts layers mix no tokens
        assert {"mlp", "moe", "linear_attention"} <= set(layer_types)
        kinds = ["linear_attention"]
    assert stateful_layer_types(config) == kinds, layer_types


def test_sample_packing_with_a_stateful_model_is_refused_and_one_sample_per_row_is_not(write_recipe):
    """Refused where every launch checks the model (the launcher's preflight, and each rank before loading)."""
    config = qwen3_5_config()
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    packed = RunPlan.build(load_recipe(write_recipe(sample_packing=True)), 1)
    with pytest.raises(CptuneError) as refused:
        packed.check_model(config, model_class)
    assert str(refused.value).startswith(
        "sample_packing: base_model qwen3_5_text has layers of type ['linear_attention'], which carry a state "
        "from each token to the next across a whole row"
    ), str(refused.value)
    assert "Set sample_packing: false" in str(refused.value)
    RunPlan.build(load_recipe(write_recipe(sample_packing=False)), 1).check_model(config, model_class)
