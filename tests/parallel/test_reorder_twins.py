"""The reorder twins of the parity checks (tests/parallel/reorder_twins.py) are legal reorders.

Each twin must compute the cp=1 reference's function (else its distance is no reorder floor: a twin
with another function would widen the floor and let bugs through) and must add in another order
(else it is no draw of the noise and the floor rests on fewer twins than ``BF16_FACTOR`` counts, or
than tests/numerics.py's ``FP32_TWINS_FACTOR`` counts for the fp32 twins, ``FP32_TWINS``). The same
function is checked by the twins rule among the twins in fp32, or in float64 (tests/token_orders.py's
``assert_legal_twin``: the twin within fp32's resolution of the reference, where float64's own reorders
land about 1e-14 from it), the other order in fp32 or bf16 (not bit-identical). The fp32 twins also serve the references the bf16 cases never have:
bidirectional (cptune's attention with a document mask) and gpt-oss (transformers' eager attention given
the documents' masks); the token-order twins (``TOKEN_ORDER_TWINS``) serve the references without windows.
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
from devtools.tiny import build_tiny_gpt_oss, build_tiny_mistral, build_tiny_model, tiny_llama_config
from tests.numerics import assert_float64_twins_rule
from tests.parallel.masked_eager import MaskedEagerBackend
from tests.parallel.reorder_twins import TOKEN_ORDER_TWINS, TWINS, fp32_twins, sdpa_twin_runs
from tests.token_orders import assert_distinct_draws, assert_legal_twin

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


def twin_logits(
    model: torch.nn.Module, twin, batch: TokenBatch, reference: str = "sdpa", causal: bool = True
) -> torch.Tensor:
    twin_model = copy.deepcopy(model)
    twin_model.set_attn_implementation(twin.attn_implementation(reference))
    return logits(twin_model, twin.backend(causal=causal), batch, twin.context)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_every_twin_computes_the_reference_function(family):
    """sdpa's math backend and the document twin: legal in float64 (``assert_legal_twin``). Eager attention computes
    its softmax in fp32 in a float64 model too, so it is held by the twins rule (tests/numerics.py) in fp32 instead:
    its logits at most 32x as far from the float64 reference's as the farthest of the fp32 reference's (sdpa,
    LocalBackend) and the other 2 twins'. (On this CPU it rounds bit for bit as sdpa's math backend does in fp32,
    which makes that check hold trivially; there its function is the math backend's, checked in float64.)"""
    register_attention()
    model = BUILDERS[family]().float()
    model.set_attn_implementation("sdpa")
    model64 = copy.deepcopy(model).double()
    batch = packed_batch()
    reference = {"logits": logits(model, LocalBackend(causal=True), batch)}
    ref64 = {"logits": logits(model64, LocalBackend(causal=True), batch)}
    twins = {twin.name: {"logits": twin_logits(model, twin, batch)} for twin in TWINS}
    for twin in TWINS:
        what = f"{family} {twin.name}"
        if twin.name == "eager":
            others = [reference, *(t for n, t in twins.items() if n != twin.name)]
            assert_float64_twins_rule(twins[twin.name], others, ref64, what=what)
            assert not torch.equal(twins[twin.name]["logits"], reference["logits"]), what
        else:
            twin64 = {"logits": twin_logits(model64, twin, batch)}
            assert_legal_twin(twin64, ref64, twins[twin.name], reference, what)


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


def eager_experts(model: torch.nn.Module) -> torch.nn.Module:
    model.set_experts_implementation("eager")  # torch's grouped_mm takes no float64 reference
    return model


# The fp32 references of the parity workers: (model, attention implementation, its cp=1 backend, causal).
FP32_REFERENCES = {
    "llama-causal": (BUILDERS["llama"], "sdpa", lambda: LocalBackend(causal=True), True),
    "llama-bidirectional": (BUILDERS["llama"], "cptune", lambda: LocalBackend(causal=False), False),
    "mistral-causal": (BUILDERS["mistral"], "sdpa", lambda: LocalBackend(causal=True), True),
    "gpt-oss": (
        lambda: eager_experts(build_tiny_gpt_oss(VOCAB, seed=1, sliding_window=5)),
        "gpt_oss_masked_eager",
        lambda: MaskedEagerBackend(5),
        True,
    ),
}


#: The references without sliding windows or sinks, which the token-order twins serve too.
UNWINDOWED = ("llama-causal", "llama-bidirectional")


@pytest.mark.parametrize("reference_name", sorted(FP32_REFERENCES))
def test_every_fp32_twin_computes_the_reference_function_and_adds_in_another_order(reference_name):
    """Each fp32 twin of a parity worker's fp32 reference (``fp32_twins``), and the token-order twins of a reference
    without windows: its logits in float64 within fp32's resolution of the float64 reference's, and in fp32 not
    bit-identical to the reference's (a draw of the reorder noise; ``assert_legal_twin``) nor to another twin's
    (``assert_distinct_draws``)."""
    register_attention()
    build, attention, backend, causal = FP32_REFERENCES[reference_name]
    model = build().float()
    local = backend()  # registers gpt-oss's masked eager attention
    model.set_attn_implementation(attention)
    model64 = copy.deepcopy(model).double()
    batch = packed_batch()
    reference = logits(model, local, batch)
    ref64 = logits(model64, local, batch)
    twins = fp32_twins(attention) + (TOKEN_ORDER_TWINS if reference_name in UNWINDOWED else ())
    assert twins, reference_name
    draws = [{"logits": reference}]
    for twin in twins:
        got = twin_logits(model, twin, batch, attention, causal)
        got64 = twin_logits(model64, twin, batch, attention, causal)
        what = f"{reference_name} {twin.name}"
        assert_legal_twin({"logits": got64}, {"logits": ref64}, {"logits": got}, {"logits": reference}, what)
        draws.append({"logits": got})
    assert_distinct_draws(draws, reference_name)


@pytest.mark.parametrize("padded", [False, True], ids=["rows", "padded-rows"])
def test_the_sdpa_twins_compute_the_reference_function_and_add_in_other_orders(padded):
    """``sdpa_twin_runs``' twins (sdpa's math backend, sdpa over the tokens in a strided order) of a plain sdpa model call, with
    transformers' own masks (causal; causal and padding): each legal (``assert_legal_twin``), and the reference and
    the two twins bit-identical to no other (``assert_distinct_draws``: each a draw of its own; eager attention was
    not: it rounds as the math backend does)."""
    model = BUILDERS["llama"]().float()
    model.set_attn_implementation("sdpa")
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(2))
    kwargs = {"input_ids": ids}
    if padded:
        kwargs["attention_mask"] = (torch.arange(20) < torch.tensor([[20], [15], [9]])).long()
    real = kwargs.get(
        "attention_mask", torch.ones_like(ids)
    ).bool()  # padded positions' logits are not compared
    with torch.no_grad():
        reference, ref64 = (m(**kwargs).logits[real] for m in (model, model64))
        twins = sdpa_twin_runs(model, lambda: model(**kwargs).logits[real])
        twins64 = sdpa_twin_runs(model64, lambda: model64(**kwargs).logits[real])
    for name, twin, twin64 in zip(("sdpa-math", "tokens strided"), twins, twins64, strict=True):
        assert_legal_twin(
            {"logits": twin64}, {"logits": ref64}, {"logits": twin}, {"logits": reference}, name
        )
    assert_distinct_draws([{"logits": r} for r in (reference, *twins)], "sdpa twins")
    assert model.config._attn_implementation == "sdpa"
