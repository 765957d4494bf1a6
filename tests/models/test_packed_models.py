"""Models whose layers would not see a packed sample as they see it alone.

Packed samples are kept apart by position_ids restarting at each sample; transformers turns them into
attention masks for the models that route attention through its AttentionInterface, but not for older
models (Bloom, Falcon, MPT), it runs layers that carry a state from token to token (linear attention,
Mamba, convolutions) over the whole row, and Llama 4 scales its NoPE layers' queries by the token's place
in the row. cptune refuses sample packing for such models instead of training a sample unlike itself alone.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from cptune.config.loader import load_recipe
from cptune.errors import CptuneError
from cptune.parallel.backends.attention import (
    PACKED_MASKS_FROM_POSITION_IDS,
    PER_SAMPLE_RECURRENCE,
    row_position_temperature,
    stateful_layer_types,
    windowed_layer_types,
)
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


ROUNDING = 1.2e-7 * 32 * 3
"""float32 rounding of a tiny model's logits computed over other row lengths: eps x a hidden size of 32 x values
below 3 (the bound every packed-versus-alone comparison in float32 here is held to)."""


LINEAR_ATTENTION = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 1,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
EXPERTS = {
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}


def qwen3_5_config(vocab_size: int = 64) -> transformers.PretrainedConfig:
    """A two-layer Qwen3.5: one gated-delta-rule (linear attention) layer, then one full-attention layer."""
    return transformers.Qwen3_5TextConfig(**{**SMALL, "vocab_size": vocab_size}, **LINEAR_ATTENTION)


# The model types whose linear-attention layers cptune runs per sample (PER_SAMPLE_RECURRENCE), two layers each.
PER_SAMPLE = {
    "qwen3_5_text": qwen3_5_config,
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(**SMALL, **LINEAR_ATTENTION, **EXPERTS),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**SMALL, **LINEAR_ATTENTION, **EXPERTS),
}


def second_sample_gap(config: transformers.PretrainedConfig) -> float:
    """The largest logit difference of a sample packed after 6 tokens of another from the same sample alone."""
    from cptune.parallel.backends.local.runtime import transformers_attention

    torch.manual_seed(0)
    # transformers' attention as cptune runs it at cp=1: sdpa, or eager where there is none.
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=transformers_attention(config)
    ).eval()
    first, second = torch.randint(0, 64, (1, 6)), torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        alone = model(input_ids=second, position_ids=torch.arange(9)[None], use_cache=False).logits
        packed_ids = torch.cat([first, second], 1)
        positions = torch.cat([torch.arange(6), torch.arange(9)])[None]
        packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits[:, 6:]
    return float((packed - alone).abs().max())


def test_transformers_carries_a_linear_attention_state_across_packed_samples():
    """Why packing is refused: the second sample of a packed row is not computed as it is alone.

    Its attention layer keeps the samples apart (without a cache, transformers turns position_ids that
    restart at 0 into a mask per sample: a Llama is exact here to fp32 rounding, about 1e-7); the
    linear-attention layer does not. The gap is the first sample's state (6e-3 for this seed), far above
    rounding; if transformers ever restarts these layers at each sample, this fails and the refusal can go."""
    assert second_sample_gap(qwen3_5_config()) > 10 * ROUNDING


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
    if kinds is None:
        # NemotronH: its Mamba layers count, its MLP and mixture-of-experts layers mix no tokens.
        assert {"mlp", "moe", "linear_attention"} <= set(layer_types)
        kinds = ["linear_attention"]
    assert stateful_layer_types(config) == kinds, layer_types


def lfm2_config() -> transformers.PretrainedConfig:
    """A two-layer LFM2: a short-convolution layer, then a full-attention layer."""
    return transformers.Lfm2Config(
        **{k: v for k, v in SMALL.items() if k != "head_dim"}, layer_types=["conv", "full_attention"]
    )


def test_sample_packing_with_a_stateful_model_is_refused_and_one_sample_per_row_is_not(write_recipe):
    """Refused where every launch checks the model (the launcher's preflight, and each rank before loading)."""
    config = lfm2_config()
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    packed = RunPlan.build(load_recipe(write_recipe(sample_packing=True)), 1)
    with pytest.raises(CptuneError) as refused:
        packed.check_model(config, model_class)
    assert str(refused.value).startswith(
        "sample_packing: base_model lfm2 has layers of type ['conv'], which carry a state "
        "from each token to the next across a whole row"
    ), str(refused.value)
    assert "Set sample_packing: false" in str(refused.value)
    RunPlan.build(load_recipe(write_recipe(sample_packing=False)), 1).check_model(config, model_class)
    # Qwen3.5's linear-attention layers run sample by sample (cptune.models.document_recurrence): not refused.
    qwen = qwen3_5_config()
    packed.check_model(qwen, transformers.AutoModelForCausalLM._model_mapping[type(qwen)])


def weighted_sum(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """A loss that weighs every logit (fixed random weights): its gradient reaches every parameter."""
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed), dtype=logits.dtype)
    return (logits * weights).sum()


def test_every_per_sample_model_type_is_tested():
    assert set(PER_SAMPLE) == set(PER_SAMPLE_RECURRENCE)


@pytest.mark.parametrize("model_type", sorted(PER_SAMPLE))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_linear_attention_runs_each_packed_sample_as_it_runs_alone_forward_and_backward(
    model_type, checkpointing
):
    """Two packed rows of three samples each and a row of one, against each sample alone, in float64; with gradient
    checkpointing, the backward's recomputation (without the decoder layer's hooks) runs per sample too.

    Bounds: logits to float64 rounding of matrix products over other row lengths (eps 2.2e-16 x a hidden
    size of 32 x values below 10: 1e-13); parameter gradients to float32 rounding (Qwen3.5's RMSNorm and
    its delta rule compute in float32 in a float64 model) of sums over the 21 tokens taken in another order
    (1.2e-7 x 21 of the largest gradient)."""
    from cptune.models.document_recurrence import enable_document_recurrence

    torch.manual_seed(0)
    # The experts as a loop of matrix products: torch's grouped one takes no float64.
    model = transformers.AutoModelForCausalLM.from_config(
        PER_SAMPLE[model_type](), experts_implementation="eager"
    )
    model = model.double()
    if checkpointing:
        model.train()  # transformers checkpoints in training only (the model has no dropout)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lengths = [[7, 5, 9], [4, 12, 5], [21]]  # the last row holds one sample, as an unpacked row does
    rows = [[torch.randint(0, 64, (1, n)) for n in row] for row in lengths]

    alone, total = [], 0
    for r, row in enumerate(rows):
        for i, ids in enumerate(row):
            logits = model(
                input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False
            ).logits
            alone.append(logits.detach())
            total = total + weighted_sum(logits, 10 * r + i)
    total.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    hooks = enable_document_recurrence(model)
    assert len(hooks) == 1  # the one linear-attention layer
    input_ids = torch.cat([torch.cat(row, 1) for row in rows])
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    total, k = 0, 0
    for r, row in enumerate(lengths):
        start = 0
        for i, n in enumerate(row):
            part = logits[r : r + 1, start : start + n]
            assert (part - alone[k]).abs().max() <= 1e-13
            total, k, start = total + weighted_sum(part, 10 * r + i), k + 1, start + n
    total.backward()
    for name, p in model.named_parameters():
        bound = 1.2e-7 * 21 * reference[name].abs().max()
        assert (p.grad - reference[name]).abs().max() <= bound, name

    for hook in hooks:  # without the hooks the linear-attention layer runs across the samples
        hook.remove()
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    assert (logits[0:1, 7:12] - alone[1]).abs().max() > 10 * ROUNDING


def test_a_packed_qwen3_5_run_loads_with_its_layers_run_per_sample_and_an_unpacked_one_without(tmp_path):
    """cptune's model loading installs the hooks exactly when the recipe packs."""
    from cptune.config.recipe import Recipe
    from cptune.models.loading import load_model

    folder = tmp_path / "qwen3_5"
    transformers.AutoModelForCausalLM.from_config(qwen3_5_config()).save_pretrained(folder)
    for packing, hooks in ((True, 1), (False, 0)):
        recipe = Recipe.model_validate(
            {"base_model": str(folder), "datasets": [{"path": "d.jsonl"}], "sample_packing": packing}
        )
        model = load_model(recipe, "sdpa")
        mixer = model.model.layers[0].linear_attn
        assert len(mixer._forward_hooks) == hooks


def llama4_config(floor_scale: int) -> transformers.PretrainedConfig:
    """A two-layer Llama 4 text model whose second layer has no rotary embedding (a NoPE layer)."""
    return transformers.Llama4TextConfig(
        **SMALL,
        intermediate_size_mlp=64,
        num_local_experts=1,
        attention_chunk_size=64,
        no_rope_layers=[1, 0],
        floor_scale=floor_scale,
        attn_scale=1.0,
    )


def test_llama4_scales_a_packed_sample_by_its_place_in_the_row():
    """With rows shorter than floor_scale every scale is 1 and packing is exact, to float32 rounding of sums over
    a hidden size of 32 of values below 3 (ROUNDING); with floor_scale 4 the packed sample's NoPE queries are
    scaled by its place in the row (7.6e-4 here, 60 times that bound)."""
    assert second_sample_gap(llama4_config(floor_scale=8192)) <= ROUNDING
    assert second_sample_gap(llama4_config(floor_scale=4)) > 10 * ROUNDING


def test_sample_packing_of_rows_that_reach_floor_scale_is_refused_for_llama4(write_recipe):
    config = llama4_config(floor_scale=128)
    assert row_position_temperature(config) == 128
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    plan = RunPlan.build(load_recipe(write_recipe(sample_packing=True, sequence_len=128)), 1)
    with pytest.raises(CptuneError) as refused:
        plan.check_model(config, model_class)
    assert str(refused.value).startswith(
        "sample_packing: base_model llama4_text scales the queries of its layers without rotary embeddings by "
        "each token's place in the row, in steps of floor_scale: 128 tokens"
    ), str(refused.value)
    shorter = RunPlan.build(load_recipe(write_recipe(sample_packing=True, sequence_len=127)), 1)
    shorter.check_model(config, model_class)  # every scale is 1 in rows below floor_scale
    every_layer_rotary = llama4_config(floor_scale=128)
    every_layer_rotary.no_rope_layers = [1, 1]
    assert row_position_temperature(every_layer_rotary) is None
    plan.check_model(every_layer_rotary, model_class)


@pytest.mark.parametrize(
    "config",
    [
        transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=2),
        transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2),
    ],
    ids=["bloom", "falcon"],
)
def test_packing_is_refused_for_a_model_whose_own_masks_let_packed_samples_attend_to_each_other(
    config, write_recipe
):
    """Without cptune's attention (not through the AttentionInterface) transformers' own mask is the row's."""
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    assert not getattr(model_class, "_supports_attention_backend", False)
    assert second_sample_gap(config) > 10 * ROUNDING  # 3e-3 (Bloom), 0.2 (Falcon)
    with pytest.raises(CptuneError) as refused:
        RunPlan.build(load_recipe(write_recipe(sample_packing=True)), 1).check_model(config, model_class)
    assert str(refused.value).startswith(
        f"sample_packing: base_model {model_class.__name__} does not route its attention through transformers' "
        "AttentionInterface, so neither cptune's attention nor transformers' masks from position_ids keep its "
        "packed samples apart"
    ), str(refused.value)
    RunPlan.build(load_recipe(write_recipe(sample_packing=False)), 1).check_model(config, model_class)


# Tiny configs of the model types cptune leaves to transformers' masks with packing at cp=1: every layer kind of
# the type, two layers, windows of 4 tokens (shorter than the samples below).
_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "sliding_window": 4,
    "attention_chunk_size": 4,
    "moe_intermediate_size": 32,
    "num_experts": 2,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
}
_TINY_EXTRA = {
    "gemma3n_text": {
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 64,
        "laurel_rank": 4,
        "activation_sparsity_pattern": [0.0, 0.0],
        "intermediate_size": [64, 64],
    },
    "gemma4_text": {"global_head_dim": 16, "num_global_key_value_heads": 1},
    "phi3": {"pad_token_id": 0},
    "qwen2": {"use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"]},
}


def tiny_config(model_type: str) -> transformers.PretrainedConfig:
    """A two-layer model of ``model_type`` whose windowed (or chunked) layers alternate with its full ones."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    fields = {k: v for k, v in _TINY.items() if k in defaults or k == "sliding_window"}
    kinds = list(dict.fromkeys(defaults.get("layer_types") or []))
    if kinds:
        fields["layer_types"] = (kinds * 2)[:2] if len(kinds) > 1 else kinds * 2
    return config_class(**{**fields, **_TINY_EXTRA.get(model_type, {})})


@pytest.mark.parametrize("model_type", sorted(PACKED_MASKS_FROM_POSITION_IDS))
def test_each_model_type_left_to_transformers_masks_keeps_packed_samples_apart(model_type):
    """The types cptune lets pack at cp=1 through transformers' own masks, against a sample packed after 6 tokens
    of another, to ROUNDING; afmoe, whose masks ignore position_ids, is the counter-example."""
    config = tiny_config(model_type)
    text = config.get_text_config()
    assert text.model_type == model_type and windowed_layer_types(text), windowed_layer_types(text)
    assert second_sample_gap(config) <= ROUNDING


def test_a_windowed_model_whose_masks_ignore_position_ids_is_refused_to_pack_at_cp1(write_recipe):
    config = tiny_config("afmoe")
    assert second_sample_gap(config) > 10 * ROUNDING  # its packed samples attend to each other (0.56)
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    with pytest.raises(CptuneError) as refused:
        RunPlan.build(load_recipe(write_recipe(sample_packing=True)), 1).check_model(config, model_class)
    assert str(refused.value).startswith(
        "sample_packing: base_model afmoe has attention layers of type ['sliding_attention'], which at "
        "context_parallel_size: 1 transformers computes with masks of its own"
    ), str(refused.value)
    RunPlan.build(load_recipe(write_recipe(sample_packing=False)), 1).check_model(config, model_class)


def test_a_model_without_an_sdpa_path_runs_transformers_eager_attention_at_cp1():
    """Gemma 2 has no sdpa in transformers 5.23: loading it with sdpa fails, so cp=1 takes eager."""
    from cptune.parallel.backends.local.runtime import transformers_attention

    assert transformers_attention(tiny_config("gemma2")) == "eager"
    assert transformers_attention(tiny_config("mistral")) == "sdpa"
    with pytest.raises(ValueError, match="does not support an attention implementation through"):
        transformers.AutoModelForCausalLM.from_config(tiny_config("gemma2"), attn_implementation="sdpa")
