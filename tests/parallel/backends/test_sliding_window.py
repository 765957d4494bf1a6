"""Sliding-window layers: which backend takes them, with transformers' window semantics, and the checks.

The distributed parity of windowed models (cp=2 and cp=4 against cp=1) is in
tests/parallel/test_parity.py (ring-flash-attn) and tests/parallel/test_ulysses_parity.py (deepspeed).
Their cp=1 reference is transformers' own sdpa on packed rows; this file checks that reference
against transformers' attention run on each document alone as an unpacked row (its plain
sliding-window mask, no packing), so the window semantics the parity tests hold CP to are
transformers'. (sdpa, not eager: transformers' eager attention takes its softmax in float32 even for
a float64 model, which would blur a float64 comparison.)
"""

from __future__ import annotations

import re

import pytest
import torch

from cptune.errors import CptuneError
from cptune.parallel.backends.attention import (
    ATTENTION_KWARG,
    AttentionCall,
    check_layers_served,
    count_windowed_layers,
    register_attention,
)
from cptune.parallel.backends.document_attention import (
    DOCUMENT_ATTENTION_NAME,
    DocumentAttention,
    register_document_attention,
    window_mask,
)
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.shard import TokenBatch
from devtools.tiny import build_tiny_gemma3_text, build_tiny_mistral
from tests.numerics import assert_within, reorder_bound
from tests.parallel.backends.windowed_rows import DOCUMENTS, VOCAB, WINDOW, logits, packed_batch

BUILDERS = {"mistral": build_tiny_mistral, "gemma3": build_tiny_gemma3_text}


def per_document(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """transformers' sdpa on each document of the row alone, an unpacked row (no packing: the plain window)."""
    model.set_attn_implementation("sdpa")
    pieces, start = [], 0
    for n in DOCUMENTS:
        pieces.append(logits(model, {"input_ids": batch.input_ids[:, start : start + n]}))
        start += n
    return torch.cat(pieces, dim=1)


def same_function_bound(reference: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """Two float64 evaluations of the same logits with the attention's sums in other orders: each layer
    reorders chains of at most hidden + intermediate + tokens terms; the bound scales by the largest logit."""
    config = model.config
    chain = config.num_hidden_layers * (config.hidden_size + config.intermediate_size + sum(DOCUMENTS))
    return reorder_bound(chain, reference.abs().max(), torch.float64)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_cp1_reference_is_transformers_sliding_window_per_document(family):
    """The parity tests' cp=1 reference (LocalBackend: transformers' sdpa on packed rows) equals transformers'
    attention on each document alone, unpacked, and the window matters (without it the logits differ)."""
    model = BUILDERS[family](VOCAB, seed=1, sliding_window=WINDOW).double()
    batch = packed_batch()
    model.set_attn_implementation("sdpa")
    reference = logits(model, LocalBackend(causal=True).shard(batch).model_kwargs)
    expected = per_document(model, batch)
    assert_within(reference, expected, same_function_bound(expected, model), f"{family} packed vs unpacked")

    windowless = BUILDERS[family](VOCAB, seed=1, sliding_window=len(DOCUMENTS) * 100).double()
    assert (per_document(windowless, batch) - expected).abs().max() > 1e-3  # the window is live


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_ulysses_document_attention_applies_each_layers_window(family):
    """DeepSpeed's core attention (``ulysses_attn_implementation: cptune``) on whole rows, as each rank runs it
    for its heads after the all-to-all, equals transformers' sdpa reference; it is told every windowed
    layer's window (Gemma 3: 2 of its 3 layers) and the full layers attend without one."""
    register_document_attention()
    model = BUILDERS[family](VOCAB, seed=1, sliding_window=WINDOW).double()
    batch = packed_batch()
    model.set_attn_implementation("sdpa")
    reference = logits(model, LocalBackend(causal=True).shard(batch).model_kwargs)
    model.set_attn_implementation(DOCUMENT_ATTENTION_NAME)
    call = AttentionCall(DocumentAttention(causal=True), takes_window=True)
    got = logits(
        model, {"input_ids": batch.input_ids, "position_ids": batch.position_ids, ATTENTION_KWARG: call}
    )
    assert_within(got, reference, same_function_bound(reference, model), f"{family} document attention")
    windowed = count_windowed_layers(model.config)
    assert windowed == {"mistral": 2, "gemma3": 2}[family]
    check_layers_served(call, model.config.num_hidden_layers, windowed)


def test_window_mask_is_transformers_sliding_window():
    """``0 <= q - k < window``: transformers' ``sliding_window_overlay`` and'ed with causal."""
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay

    overlay, n = sliding_window_overlay(3), 7
    expected = torch.tensor(
        [
            [bool(overlay(0, 0, q, k)) and bool(causal_mask_function(0, 0, q, k)) for k in range(n)]
            for q in range(n)
        ]
    )
    assert torch.equal(window_mask(n, 3, torch.device("cpu")), expected)


def test_varlen_attention_takes_the_window_as_document_attention_does():
    """The GPU path of DeepSpeed's core attention (one varlen call, here on the CPU stand-ins) against one
    masked SDPA call per document, forward and gradients, in float64 (the same sums in other orders)."""
    from cptune.parallel.kernels import flash_attn_cpu
    from cptune.parallel.kernels.varlen import varlen_attention

    generator = torch.Generator().manual_seed(0)
    total, heads, kv_heads, dim = sum(DOCUMENTS), 4, 2, 8
    q, k, v = (
        torch.randn(total, h, dim, generator=generator, dtype=torch.float64, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    bounds = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    out = varlen_attention(q, k, v, bounds, max(DOCUMENTS), scale=None, causal=True, window=WINDOW)
    dout = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    got = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    expected_out = DocumentAttention(causal=True).rows(
        q[None], k[None], v[None], None, positions, window=WINDOW
    )[0]
    expected = (expected_out.detach(), *torch.autograd.grad(expected_out, (q, k, v), dout))
    # The output: chains of at most 3 x the longest document's terms (scores, normalisation, weighted sum)
    # in other orders, scaled by the largest value involved.
    assert_within(
        got[0],
        expected[0],
        reorder_bound(3 * max(DOCUMENTS), v.detach().abs().max() + 1, torch.float64),
        "out",
    )
    # The gradients: flash-attn's kernels keep the log-sum-exp in float32 (its layout), so the backward
    # recomputes each probability with relative error up to u32 x |lse|; each gradient sums at most the
    # longest document's probabilities, times (|dout . v| + |dout . out|) x |q or k| x scale, or |dout|.
    with torch.no_grad():  # the kernel's own (windowed) log-sum-exp
        lse = flash_attn_cpu._flash_attn_varlen_forward(
            q, k, v, bounds, bounds, max(DOCUMENTS), max(DOCUMENTS), 0.0, None, True, WINDOW - 1, -1
        )[1]
    delta = torch.finfo(torch.float32).eps / 2 * lse.abs().max()
    dout_l1 = dout.abs().sum(-1).max()
    term = (
        dout_l1
        * (v.abs().max() + expected[0].abs().max())
        * torch.stack([q.abs().max(), k.abs().max()]).max()
    )
    limit = delta * max(DOCUMENTS) * (term * dim**-0.5 + dout.abs().max())
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], expected[1:], strict=True):
        assert_within(
            a, b, limit.detach() + reorder_bound(6 * max(DOCUMENTS), b.abs().max(), torch.float64), name
        )
    with pytest.raises(ValueError, match="causal attention only"):
        varlen_attention(q, k, v, bounds, max(DOCUMENTS), scale=None, causal=False, window=WINDOW)


def test_a_window_reaching_a_call_that_cannot_take_it_is_an_error():
    """A backend whose attention computes full attention never silently drops a layer's window."""
    register_attention()
    model = build_tiny_mistral(VOCAB, seed=1, sliding_window=WINDOW)
    model.set_attn_implementation("cptune")
    batch = packed_batch()
    call = AttentionCall(lambda q, k, v, scale: q)  # takes no window
    kwargs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, ATTENTION_KWARG: call}
    with pytest.raises(CptuneError, match=r"sliding-window layer \(sliding_window: 5\) reached"):
        model(**kwargs, use_cache=False)


def test_windowed_layers_that_do_not_pass_their_window_are_caught():
    call = AttentionCall(lambda q, k, v, scale, window=None: q, takes_window=True)
    call.layers_served = 3
    call.windowed_layers_served = 1
    with pytest.raises(CptuneError, match="in 1 of its 2 sliding-window layers"):
        check_layers_served(call, 3, windowed=2)
    check_layers_served(call, 3)  # the count of windows is checked only when asked


# --- the model checks, before loading -------------------------------------------------------------------


def check(config, **keys):
    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.select import check_model_config
    from cptune.parallel.backends.table import backend_for
    from cptune.parallel.layout import ParallelDims

    recipe = Recipe.model_validate({"base_model": "m", "datasets": [{"path": "d.jsonl"}], **keys})
    dims = ParallelDims(world_size=recipe.context_parallel_size, cp_size=recipe.context_parallel_size)
    check_model_config(backend_for(recipe), recipe, dims, config, None)


SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
CP2 = {"context_parallel_size": 2}
TORCH = {**CP2, "cp_backend": "torch", "sample_packing": False}
ZIGZAG = {**CP2, "ring_attn_func": "batch_zigzag", "bf16": True, "sample_packing": False}
DEEPSPEED = {**CP2, "cp_backend": "deepspeed"}


def windowed_configs():
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    return {
        "mistral": MistralConfig(sliding_window=16, **SMALL),
        "qwen2": Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=1, **SMALL),
        "gemma3_text": Gemma3TextConfig(sliding_window=16, **{**SMALL, "num_hidden_layers": 6}),
    }


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3_text"])
def test_windowed_models_are_taken_where_the_window_is_exact(family):
    config = windowed_configs()[family]
    check(config)  # cp=1 causal: transformers' own attention
    check(config, **CP2)  # ring-flash-attn, varlen_llama3
    check(config, **ZIGZAG)  # ring-flash-attn, batch_zigzag: cptune's zigzag ring with windows
    check(config, **DEEPSPEED)  # ulysses_attn_implementation: cptune
    check(config, **DEEPSPEED, ulysses_attn_implementation="flash_attention_2")


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3_text"])
@pytest.mark.parametrize(
    ("keys", "backend", "reason"),
    [
        (TORCH, "cp_backend: torch", "rings the attention with is_causal only and takes no mask or window"),
        ({**CP2, "causal": False}, r"\(ring_attn_func: varlen_llama3\)", "sliding windows are causal only"),
        ({**DEEPSPEED, "causal": False}, "ulysses_attn_implementation: cptune", "causal only"),
        (
            {**DEEPSPEED, "ulysses_attn_implementation": "sdpa", "sample_packing": False},
            "ulysses_attn_implementation: sdpa",
            "drops the attention mask",
        ),
        ({"causal": False}, "context_parallel_size: 1|cptune", "silently see too much"),
    ],
    ids=[
        "torch",
        "ring-bidirectional",
        "deepspeed-bidirectional",
        "deepspeed-sdpa",
        "cp1-bidirectional",
    ],
)
def test_windowed_models_are_refused_before_loading_naming_model_layer_type_and_backend(
    family, keys, backend, reason
):
    config = windowed_configs()[family]
    with pytest.raises(CptuneError) as refused:
        check(config, **keys)
    message = str(refused.value)
    assert f"base_model: {config.model_type} has attention layers of type ['sliding_attention']" in message
    assert re.search(backend, message), message
    assert re.search(reason, message), message


def test_chunked_layers_and_soft_capping_are_refused():
    from transformers import Gemma2Config, LlamaConfig

    chunked = LlamaConfig(**SMALL)
    chunked.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(CptuneError, match=r"attends sliding windows only, not \['chunked_attention'\]"):
        check(chunked, **CP2)
    gemma2 = Gemma2Config(sliding_window=16, **SMALL)
    with pytest.raises(
        CptuneError, match=r"gemma2 soft-caps its attention logits \(attn_logit_softcapping: 50"
    ):
        check(gemma2, **CP2)
    check(gemma2)  # cp=1 causal: transformers' own attention applies it
