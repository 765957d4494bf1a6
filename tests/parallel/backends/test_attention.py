import pytest
import torch

from cptune.errors import CptuneError
from cptune.parallel.backends.attention import (
    AttentionCall,
    check_layers_served,
    count_attention_layers,
    register_attention,
)
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.shard import TokenBatch
from devtools.tiny import build_tiny_model, tiny_llama_config
from tests.numerics import assert_within, reorder_bound


def tiny_model():
    register_attention()
    model = build_tiny_model(tiny_llama_config(50), seed=0)
    model.set_attn_implementation("cptune")
    return model


def batch():
    ids = torch.randint(3, 50, (1, 8))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    return TokenBatch(ids, positions, ids.clone())


def test_every_layer_goes_through_the_call():
    model = tiny_model()
    sharded = LocalBackend(causal=False).shard(batch())
    model(**sharded.model_kwargs, use_cache=False)
    check_layers_served(sharded.call, count_attention_layers(model))
    assert sharded.call.layers_served == 2


def test_the_call_survives_wrappers_that_map_over_forward_kwargs():
    # FSDP2 with mixed precision casts every tensor in a forward's kwargs through this function,
    # which rebuilds dataclasses: the layers then counted on a copy, and the trainer saw 0 layers.
    from torch.distributed.utils import _apply_to_tensors

    model = tiny_model()
    sharded = LocalBackend(causal=False).shard(batch())
    cast = _apply_to_tensors(lambda t: t.clone(), dict(sharded.model_kwargs))
    assert cast["cp_attention"] is sharded.call
    model(**cast, use_cache=False)
    check_layers_served(sharded.call, count_attention_layers(model))


def test_a_layer_that_bypasses_the_backend_is_an_error():
    model = tiny_model()
    layer = model.model.layers[1].self_attn

    def shard_local_attention(hidden_states, *args, **kwargs):
        # Custom attention code that never asks the AttentionInterface.
        return layer.o_proj(torch.zeros_like(hidden_states)), None

    layer.forward = shard_local_attention
    sharded = LocalBackend(causal=False).shard(batch())
    model(**sharded.model_kwargs, use_cache=False)
    with pytest.raises(CptuneError, match="ran 1 of its 2 attention layers"):
        check_layers_served(sharded.call, count_attention_layers(model))


def test_model_called_without_metadata_is_refused():
    model = tiny_model()
    with pytest.raises(CptuneError, match="needs per-batch metadata"):
        model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)


def test_bidirectional_local_attention_sees_the_future_within_a_document_only():
    q = torch.randn(1, 8, 2, 4)
    call_batch = LocalBackend(causal=False).shard(batch())
    out = call_batch.call.attend(q, q, q, None)
    # Token 0 attends to tokens 0-3 (its document) and never to 4-7.
    raw = (q[0, :4, 0] @ q[0, :4, 0].T) / 2.0
    expected = torch.softmax(raw, -1)[0] @ q[0, :4, 0]
    # Bound: 4-term scores, a 4-term normalisation and a 4-term weighted sum, the exponent's error
    # scaled by the largest score: 12 x eps x max|v| x (1 + max|score|).
    limit = reorder_bound(12, q[0, :4, 0].abs().max() * (1 + raw[0].abs().max()))
    assert_within(out[0, 0, 0], expected, limit)
    assert isinstance(call_batch.call, AttentionCall)


def test_flash_attn_on_gpu_needs_half_precision():
    from cptune.config.loader import validate_recipe
    from cptune.parallel.backends.ring_flash_attn.kernel_choice import check_ring_precision

    fp32 = validate_recipe({"base_model": "m", "datasets": [{"path": "d"}], "context_parallel_size": 2})
    with pytest.raises(CptuneError, match="bf16 and fp16 only"):
        check_ring_precision(fp32, cuda=True, flash_attn=True)
    check_ring_precision(fp32, cuda=False, flash_attn=False)  # CPU kernels take fp32
    bf16 = fp32.model_copy(update={"bf16": True})
    check_ring_precision(bf16, cuda=True, flash_attn=True)


def test_cptune_attention_needs_the_attention_interface_and_no_dropout_wherever_it_runs():
    """At cp > 1 and for causal: false at cp=1 cptune's attention replaces the model's: check before loading."""
    from transformers import BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM

    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.select import check_model_config
    from cptune.parallel.backends.table import backend_for
    from cptune.parallel.layout import ParallelDims

    def check(config, model_class, **keys):
        recipe = Recipe.model_validate({"base_model": "m", "datasets": [{"path": "d.jsonl"}], **keys})
        dims = ParallelDims(world_size=recipe.context_parallel_size, cp_size=recipe.context_parallel_size)
        check_model_config(backend_for(recipe), recipe, dims, config, model_class)

    bloom = BloomConfig(hidden_size=32, n_layer=1, n_head=2)
    small = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    dropout = LlamaConfig(attention_dropout=0.1, **small)
    with pytest.raises(
        CptuneError, match=r"so cptune cannot give it bidirectional attention \(causal: false\)"
    ):
        check(bloom, BloomForCausalLM, causal=False)
    with pytest.raises(CptuneError, match="cannot be split across context-parallel ranks"):
        check(bloom, BloomForCausalLM, context_parallel_size=2)
    for keys in (
        {"context_parallel_size": 2},
        {"causal": False},
        {"context_parallel_size": 2, "cp_backend": "deepspeed"},  # its cptune core attention
    ):
        with pytest.raises(CptuneError, match=r"sets attention_dropout: 0\.1"):
            check(dropout, LlamaForCausalLM, **keys)
    # transformers' own attention runs (and applies dropout): nothing to refuse
    check(bloom, BloomForCausalLM)
    check(dropout, LlamaForCausalLM)
    check(
        dropout,
        LlamaForCausalLM,
        context_parallel_size=2,
        cp_backend="deepspeed",
        ulysses_attn_implementation="sdpa",
    )
