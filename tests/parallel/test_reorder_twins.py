"""The reorder twins of the bf16 parity check (tests/parallel/reorder_twins.py) are legal reorders.

Each twin must compute the cp=1 reference's function (else its distance is no reorder floor: a twin
with another function would widen the floor and let bugs through) and must add in another order
(else it is no draw of the noise and the floor rests on fewer twins than ``BF16_FACTOR`` counts).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from cptune.labels import shift_labels_within_documents
from cptune.parallel.backends.attention import register_attention
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.shard import TokenBatch
from devtools.tiny import build_tiny_mistral, build_tiny_model, tiny_llama_config
from tests.numerics import assert_float64_rule
from tests.parallel.reorder_twins import TWINS

VOCAB = 97
# Two rows of 3 short documents, then a long one wider than Mistral's window of 5.
DOCUMENTS = [3, 2, 4, 15]
BUILDERS = {
    "llama": lambda: build_tiny_model(tiny_llama_config(VOCAB, num_key_value_heads=2), seed=1),
    "mistral": lambda: build_tiny_mistral(VOCAB, seed=1, sliding_window=5),
}


def packed_batch() -> TokenBatch:
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, sum(DOCUMENTS)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS]).expand(2, -1).contiguous()
    return TokenBatch(ids, positions, shift_labels_within_documents(ids.clone(), positions))


def logits(model: torch.nn.Module, backend: LocalBackend, batch: TokenBatch, context=None) -> torch.Tensor:
    with torch.no_grad(), (context or contextlib.nullcontext)():
        return model(**backend.shard(batch).model_kwargs, use_cache=False).logits


def twin_logits(model: torch.nn.Module, twin, batch: TokenBatch) -> torch.Tensor:
    twin_model = copy.deepcopy(model)
    twin_model.set_attn_implementation(twin.attn_implementation("sdpa"))
    return logits(twin_model, twin.backend(causal=True), batch, twin.context)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_every_twin_computes_the_reference_function(family):
    """Float64-reference rule (tests/numerics.py): in fp32 each twin's logits land at most 16x as far from the
    float64 reference's as the fp32 reference's (sdpa, LocalBackend) do."""
    register_attention()
    model = BUILDERS[family]().float()
    model.set_attn_implementation("sdpa")
    batch = packed_batch()
    reference = logits(model, LocalBackend(causal=True), batch)
    ref64 = logits(copy.deepcopy(model).double(), LocalBackend(causal=True), batch)
    for twin in TWINS:
        got = twin_logits(model, twin, batch)
        assert_float64_rule(
            {"logits": got}, {"logits": reference}, {"logits": ref64}, what=f"{family} {twin.name}"
        )


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_every_twin_adds_in_another_order_in_bf16(family):
    """On packed rows each twin's bf16 logits differ from the bf16 reference's: a draw of the reorder noise."""
    register_attention()
    model = BUILDERS[family]().to(torch.bfloat16)
    model.set_attn_implementation("sdpa")
    batch = packed_batch()
    reference = logits(model, LocalBackend(causal=True), batch)
    for twin in TWINS:
        assert not torch.equal(twin_logits(model, twin, batch), reference), f"{family} {twin.name}"
