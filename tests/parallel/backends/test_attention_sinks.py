"""Attention sinks (gpt-oss): the maths, the kernels that apply them, the cp=1 reference and the model checks.

The distributed parity of a tiny gpt-oss (cp=2 and cp=4 on ring-flash-attn's varlen_llama3, cp=2 on
DeepSpeed's Ulysses with cptune's core attention) is in tests/parallel/test_parity.py and
tests/parallel/test_ulysses_parity.py. Their cp=1 reference is transformers' own eager gpt-oss attention on
packed rows, given the documents' masks (tests/parallel/masked_eager.py: gpt-oss's forward does not find
packed documents itself); this file checks it against the same attention run on each document alone, in
float64.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from cptune.errors import CptuneError
from cptune.parallel.backends.attention import (
    ATTENTION_KWARG,
    AttentionCall,
    check_layers_served,
    cptune_attention_forward,
)
from cptune.parallel.backends.document_attention import (
    DOCUMENT_ATTENTION_NAME,
    DocumentAttention,
    RowDocuments,
    register_document_attention,
)
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.kernels.sinks import attention_with_sinks, with_sinks
from cptune.parallel.kernels.varlen import varlen_attention
from cptune.parallel.shard import TokenBatch
from devtools.tiny import build_tiny_gpt_oss
from tests.numerics import assert_within, reorder_bound
from tests.parallel.backends.windowed_rows import DOCUMENTS, VOCAB, WINDOW, logits, packed_batch
from tests.parallel.masked_eager import MaskedEagerBackend

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
U32 = torch.finfo(torch.float32).eps / 2


def eager_sink_attention(q, k, v, sinks, documents=DOCUMENTS, window=None):
    """gpt-oss's eager attention, document by document: softmax over [scores, sink], the sink dropped."""
    outs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in documents:
        qd = q[start : start + n].transpose(0, 1)
        kd, vd = (t[start : start + n].repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        scores = qd @ kd.transpose(1, 2) * q.shape[-1] ** -0.5
        distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        seen = (distance >= 0) & (distance < (window or n))
        scores = scores.masked_fill(~seen, float("-inf"))
        logits = torch.cat([scores, sinks[:, None, None].expand(-1, n, 1)], dim=-1)
        outs.append((logits.softmax(-1)[..., :-1] @ vd).transpose(0, 1))
        start += n
    return torch.cat(outs)


def random_inputs(dtype=torch.float64, sink_scale=1.0):
    generator = torch.Generator().manual_seed(0)
    total = sum(DOCUMENTS)
    q, k, v = (
        torch.randn(total, h, HEAD_DIM, generator=generator, dtype=dtype).requires_grad_()
        for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    sinks = (sink_scale * torch.randn(HEADS, generator=generator, dtype=dtype)).requires_grad_()
    dout = torch.randn(total, HEADS, HEAD_DIM, generator=generator, dtype=dtype)
    return q, k, v, sinks, dout


def with_grads(out, inputs, dout):
    return (out.detach(), *torch.autograd.grad(out, inputs, dout))


@dataclass(frozen=True)
class DenseFlash:
    """Float64 attention over one document with flash-attn's contract: ``(out, lse)`` forward, and a backward
    that reads ``out`` only for ``D = rowsum(dout * out)`` and ``lse`` only to rebuild the probabilities."""

    def _scores(self, q, k):
        group = q.shape[1] // k.shape[1]
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * q.shape[-1] ** -0.5
        n = q.shape[0]
        return scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))

    def forward(self, q, k, v):
        scores = self._scores(q, k)
        lse = scores.logsumexp(-1)
        group = q.shape[1] // k.shape[1]
        out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), v.repeat_interleave(group, 1))
        return out, lse

    def backward(self, dout, q, k, v, out, lse):
        group = q.shape[1] // k.shape[1]
        kx, vx = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        probs = torch.exp(self._scores(q, k) - lse[..., None])
        dv = torch.einsum("hqk,qhd->khd", probs, dout)
        dprobs = torch.einsum("qhd,khd->hqk", dout, vx)
        delta = (dout * out).sum(-1).t()
        dscores = probs * (dprobs - delta[..., None]) * q.shape[-1] ** -0.5
        dq = torch.einsum("hqk,khd->qhd", dscores, kx)
        dk = torch.einsum("hqk,qhd->khd", dscores, q)
        fold = (k.shape[0], k.shape[1], group, k.shape[2])
        return dq, dk.reshape(fold).sum(2), dv.reshape(fold).sum(2)


def test_the_sink_applied_to_the_merged_attention_is_gpt_oss_attention_forward_and_backward():
    """``out · σ(lse - s)`` and a flash backward given the sink attention's ``(out, lse)``: gpt-oss's softmax over
    [scores, sink] exactly, gradients of q, k, v and the sinks included (float64, one document of 16 tokens)."""
    q, k, v, sinks, dout = random_inputs(sink_scale=2.0)
    n = DOCUMENTS[-1]
    q, k, v, dout = (t[-n:].detach().requires_grad_(t.requires_grad) for t in (q, k, v, dout))
    got = with_grads(attention_with_sinks(DenseFlash(), q, k, v, sinks), (q, k, v, sinks), dout)
    expected = with_grads(eager_sink_attention(q, k, v, sinks, [n]), (q, k, v, sinks), dout)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected, strict=True):
        # float64 sums of at most 3 x 16 terms (scores, normalisation, weighted sum; over queries for the
        # sinks) in other orders, against the largest value involved.
        assert_within(a, b, reorder_bound(3 * n, b.abs().max(), torch.float64) * 8, name)
    assert float(got[-1].abs().max()) > 1e-3  # the sinks' gradient is live


@pytest.mark.parametrize(
    ("planted", "change"),
    [
        ("sink omitted", lambda s: s - 1e4),
        ("sink once per block of 2", lambda s: s + torch.log(torch.tensor(2.0))),
    ],
)
def test_a_sink_omitted_or_applied_per_block_is_not_gpt_oss_attention(planted, change):
    """The two wrong places to apply the sink change the output by far more than the bound above."""
    q, k, v, sinks, _ = random_inputs()
    expected = eager_sink_attention(q, k, v, sinks).detach()
    kernel = DenseFlash()
    start = sum(DOCUMENTS[:-1])
    wrong = attention_with_sinks(kernel, q[start:], k[start:], v[start:], change(sinks.detach()))
    assert (wrong.detach() - expected[start:]).abs().max() > 1e-3, planted


def test_varlen_kernels_apply_the_sinks_within_each_document_and_window():
    """The varlen kernels (the CPU stand-ins here; DeepSpeed's core attention and its GPU path) with sinks,
    packed documents and a window, against gpt-oss's eager attention per document, forward and gradients."""
    q, k, v, sinks, dout = random_inputs()
    bounds = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    out = varlen_attention(
        q, k, v, bounds, max(DOCUMENTS), scale=None, causal=True, window=WINDOW, sinks=sinks
    )
    got = with_grads(out, (q, k, v, sinks), dout)
    expected_out = eager_sink_attention(q, k, v, sinks, window=WINDOW)
    expected = with_grads(expected_out, (q, k, v, sinks), dout)
    # |lse| <= the largest |score| + log(keys)
    lse_max = float(q.detach().abs().sum(-1).max() * k.detach().abs().max()) * HEAD_DIM**-0.5 + 3
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected, strict=True):
        # The kernels keep lse in fp32 (flash-attn's layout) even for float64 inputs: one fp32 rounding of lse
        # (U32 x |lse|, |lse| <= max score + log(keys)) carried through at most 4 products (probabilities,
        # output, D, score gradients), relative to the largest value; plus float64's reordering.
        limit = 4 * U32 * lse_max * b.abs().max() + reorder_bound(
            3 * max(DOCUMENTS), b.abs().max(), torch.float64
        )
        assert_within(a, b, limit, name)


def gpt_oss(**overrides) -> torch.nn.Module:
    model = build_tiny_gpt_oss(VOCAB, seed=1, sliding_window=WINDOW, **overrides).double()
    model.set_experts_implementation("eager")  # torch's grouped_mm takes no float64
    with torch.no_grad():  # sinks of either sign and some size (initialised at std 0.02)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, HEADS, dtype=torch.float64))
    return model


def same_function_bound(reference: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """Two float64 evaluations of the same logits with their sums in other orders: each layer reorders chains of
    at most hidden + 2 x expert width + tokens terms; the bound scales by the largest logit."""
    config = model.config
    chain = config.num_hidden_layers * (config.hidden_size + 2 * config.intermediate_size + sum(DOCUMENTS))
    return reorder_bound(chain, reference.abs().max(), torch.float64)


def per_document(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """transformers' eager gpt-oss attention on each document of the row alone (no packing)."""
    model.set_attn_implementation("eager")
    pieces, start = [], 0
    for n in DOCUMENTS:
        pieces.append(logits(model, {"input_ids": batch.input_ids[:, start : start + n]}))
        start += n
    return torch.cat(pieces, dim=1)


def test_the_cp1_reference_is_transformers_eager_gpt_oss_per_document():
    """The parity tests' cp=1 reference (transformers' eager gpt-oss attention on packed rows, given the documents'
    masks) equals the same attention on each document alone, in float64; the masks and the sinks matter."""
    model = gpt_oss()
    batch = packed_batch()
    backend = MaskedEagerBackend(model.config.sliding_window)
    model.set_attn_implementation(backend.attn_implementation)
    reference = logits(model, backend.shard(batch).model_kwargs)
    expected = per_document(model, batch)
    assert_within(reference, expected, same_function_bound(expected, model), "packed vs unpacked")
    # Without the masks gpt-oss's forward lets the packed documents attend to each other (transformers 5.23).
    model.set_attn_implementation("eager")
    unmasked = logits(model, LocalBackend(causal=True).shard(batch).model_kwargs)
    assert (unmasked - expected).abs().max() > 1e-3
    sinkless = gpt_oss()
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
    assert (per_document(sinkless, batch) - expected).abs().max() > 1e-3  # the sinks are live


@pytest.mark.parametrize("head_block", [0, 1])
def test_ulysses_document_attention_applies_the_sinks_of_its_heads(head_block):
    """DeepSpeed's core attention (``ulysses_attn_implementation: cptune``) on rank ``r`` holds the r-th block of
    the query heads after the all-to-all: it applies those heads' sinks (``head_block``)."""
    q, k, v, sinks, _ = random_inputs()
    heads = slice(2 * head_block, 2 * head_block + 2)
    local_q, local_k, local_v = (
        q[:, heads],
        k[:, head_block : head_block + 1],
        v[:, head_block : head_block + 1],
    )
    documents = RowDocuments.of(torch.cat([torch.arange(n) for n in DOCUMENTS])[None], 1)
    got = DocumentAttention(causal=True, head_block=head_block).within(
        local_q[None], local_k[None], local_v[None], None, documents, WINDOW, sinks
    )[0]
    expected = eager_sink_attention(local_q, local_k, local_v, sinks[heads], window=WINDOW).detach()
    # The kernels' fp32 lse, as above.
    lse_max = float(q.detach().abs().sum(-1).max() * k.detach().abs().max()) * HEAD_DIM**-0.5 + 3
    limit = 4 * U32 * lse_max * expected.abs().max() + reorder_bound(
        3 * 16, expected.abs().max(), torch.float64
    )
    assert_within(got, expected, limit, f"head block {head_block}")


def test_ulysses_core_attention_on_whole_rows_is_the_cp1_reference():
    """The core attention, as a rank runs it after the all-to-all (here all heads: block 0), on a tiny gpt-oss:
    the eager reference's logits; every layer passed its sinks and its window (sliding, full)."""
    register_document_attention()
    model = gpt_oss()
    batch = packed_batch()
    reference = per_document(model, batch)
    model.set_attn_implementation(DOCUMENT_ATTENTION_NAME)
    call = AttentionCall(DocumentAttention(causal=True), takes_window=True, takes_sinks=True)
    got = logits(
        model, {"input_ids": batch.input_ids, "position_ids": batch.position_ids, ATTENTION_KWARG: call}
    )
    # The kernels' fp32 lse (as above; this model's |lse| <= max |score| + log(16 keys) stays below 16) through
    # 2 layers, on top of the float64 reordering.
    limit = 2 * 4 * U32 * 16 * reference.abs().max() + same_function_bound(reference, model)
    assert_within(got, reference, limit, "document attention with sinks")
    check_layers_served(call, 2, windowed=1)
    assert call.sink_layers_served == 2


def test_sinks_reaching_a_call_that_does_not_apply_them_are_an_error():
    q = torch.zeros(1, HEADS, 3, HEAD_DIM)
    call = AttentionCall(lambda *args, **kwargs: q.transpose(1, 2))
    with pytest.raises(CptuneError, match=r"learned sink logits .* does not apply them"):
        cptune_attention_forward(None, q, q, q, None, s_aux=torch.zeros(HEADS), **{ATTENTION_KWARG: call})


# --- the model checks, before loading -------------------------------------------------------------------


def check(config, **keys):
    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.select import check_model_config
    from cptune.parallel.backends.table import backend_for
    from cptune.parallel.layout import ParallelDims

    recipe = Recipe.model_validate({"base_model": "m", "datasets": [{"path": "d.jsonl"}], **keys})
    dims = ParallelDims(world_size=recipe.context_parallel_size, cp_size=recipe.context_parallel_size)
    check_model_config(backend_for(recipe), recipe, dims, config, None)


def gpt_oss_config():
    from transformers import GptOssConfig

    small = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    return GptOssConfig(sliding_window=16, num_local_experts=4, **small)


CP2 = {"context_parallel_size": 2}
ZIGZAG = {**CP2, "ring_attn_func": "batch_zigzag", "bf16": True, "sample_packing": False}
DEEPSPEED = {**CP2, "cp_backend": "deepspeed"}


def test_gpt_oss_is_taken_where_its_sinks_are_applied():
    config = gpt_oss_config()
    check(config)  # cp=1 causal: transformers' own attention
    check(config, **CP2)  # ring-flash-attn, varlen_llama3
    check(config, **ZIGZAG)  # ring-flash-attn, batch_zigzag: cptune's zigzag ring
    check(config, **DEEPSPEED)  # ulysses_attn_implementation: cptune


@pytest.mark.parametrize(
    ("keys", "backend", "reason"),
    [
        ({**CP2, "cp_backend": "torch", "sample_packing": False}, "cp_backend: torch", "takes no sink"),
        (
            {**DEEPSPEED, "ulysses_attn_implementation": "sdpa", "sample_packing": False},
            "ulysses_attn_implementation: sdpa",
            "sink logits of all heads",
        ),
        (
            {**DEEPSPEED, "ulysses_attn_implementation": "flash_attention_2"},
            "ulysses_attn_implementation: flash_attention_2",
            "sink logits of all heads",
        ),
        ({"causal": False}, "context_parallel_size: 1|cptune", "no place for a logit outside the keys"),
    ],
    ids=["torch", "deepspeed-sdpa", "deepspeed-flash-attention-2", "cp1-bidirectional"],
)
def test_gpt_oss_is_refused_where_its_sinks_are_not_applied(keys, backend, reason):
    with pytest.raises(CptuneError) as refused:
        check(gpt_oss_config(), **keys)
    message = str(refused.value)
    layers = "of type ['full_attention', 'sliding_attention']"
    assert (
        f"base_model: gpt_oss adds a learned sink logit per head to the softmax of its attention layers ({layers})"
        in message
    )
    assert re.search(backend, message), message
    assert re.search(reason, message), message


def test_gpt_oss_on_the_torch_backend_is_refused_for_its_sinks_and_its_windows_in_one_message():
    """torch's CP attention takes neither: the one message names both, so a user does not fix one to meet the other."""
    with pytest.raises(CptuneError) as refused:
        check(gpt_oss_config(), **CP2, cp_backend="torch", sample_packing=False)
    message = str(refused.value)
    assert "base_model: gpt_oss adds a learned sink logit per head" in message, message
    assert "takes no sink and returns no log-sum-exp" in message, message
    assert (
        "base_model: gpt_oss has attention layers of type ['sliding_attention'] (sliding_window: 16)"
        in message
    )
    assert "takes no mask or window" in message, message


def test_cp1_trains_gpt_oss_through_the_document_attention_with_its_windows_and_sinks():
    """At context_parallel_size 1 gpt-oss (no sdpa in transformers; its forward would let packed documents attend
    to each other) goes through cptune's document attention, which applies each layer's window and sinks: the
    eager reference on each document alone. Mistral (windows, no sinks) keeps transformers' sdpa."""
    from transformers import MistralConfig

    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.attention import register_attention
    from cptune.parallel.backends.local.runtime import attends_by_document

    recipe = Recipe.model_validate({"base_model": "m", "datasets": [{"path": "d.jsonl"}]})
    model = gpt_oss()
    assert attends_by_document(recipe, model.config)
    assert not attends_by_document(recipe, MistralConfig(sliding_window=16))
    batch = packed_batch()
    register_attention()
    local = LocalBackend(causal=True, documents=True)
    model.set_attn_implementation(local.attn_implementation)
    sharded = local.shard(batch)
    got = logits(model, sharded.model_kwargs)
    expected = per_document(model, batch)
    # The kernels' fp32 lse, as in test_ulysses_core_attention_on_whole_rows_is_the_cp1_reference.
    limit = 2 * 4 * U32 * 16 * expected.abs().max() + same_function_bound(expected, model)
    assert_within(got, expected, limit, "cp=1 document attention")
    check_layers_served(sharded.call, 2, windowed=1)
    assert sharded.call.sink_layers_served == 2


def test_the_sinks_share_of_a_row_is_the_sigmoid_of_its_lse_less_the_sink_when_both_are_large():
    """``with_sinks`` scales each row by σ(lse - s), computed in fp32 from the fp32 lse and sink, against float64.

    Bound, relative: the difference ``x = lse - s`` rounds once (``|x|·u``, which moves σ by at most that much
    relatively), ``exp`` is within 1 ulp (``2u``, torch's vectorised exp) of the exp of the rounded ``-x``, which
    moves it by ``|x|·u`` more; ``1 + exp`` and the division round once each, the product with the output once:
    ``(2|x| + 5)·u``. The share from ``exp(lse - logaddexp(lse, s))`` (before) would carry the rounding of the
    rounded log-sum-exp near 1000, half an ulp of 1000 (3e-5), into every output of the row.
    """
    generator = torch.Generator().manual_seed(0)
    heads, tokens = 4, 256
    lse = 1000 + 5 * torch.randn(heads, tokens, generator=generator)
    sinks = 1000 + 5 * torch.randn(heads, generator=generator)
    out = torch.ones(tokens, heads, 8)
    got, lse_sink = with_sinks(out, lse, sinks)
    x = lse.double() - sinks.double()[:, None]
    want = torch.sigmoid(x).transpose(0, 1)[..., None].expand(tokens, heads, 8)
    u = torch.finfo(torch.float32).eps / 2
    bound = ((2 * x.abs() + 5) * u).transpose(0, 1)[..., None] * want
    assert lse.min() > 900
    excess = float(((got.double() - want).abs() / bound).max())
    assert excess <= 1, f"the sink's share is {excess:.3g}x the bound away from float64's"
    assert torch.equal(lse_sink, torch.logaddexp(lse, sinks[:, None]))
