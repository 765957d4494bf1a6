"""cp=1 attention document by document (``LocalBackend(documents=True)``) against the masked path.

The masked path is transformers' ``sdpa`` with its block-diagonal ``tokens x tokens`` mask (causal)
or cptune's attention with :func:`document_mask` (bidirectional): the cp=1 reference until issue 30.
The document path must give its losses and gradients and never build a ``tokens x tokens`` tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cptune.models.head_loss import logits_loss
from cptune.parallel.backends.attention import check_layers_served, register_attention
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.shard import TokenBatch
from devtools.tiny import build_tiny_model, tiny_llama_config
from tests.numerics import assert_float64_twins_rule
from tests.parallel.reorder_twins import TOKEN_ORDER_TWINS

VOCAB = 64
TOKENS = 96
# Two rows: several packed documents (the last one padding), or one document and its padding.
PACKED_LENGTHS = ((30, 17, 40, 9), (50, 46))
UNPACKED_LENGTHS = ((80, 16), (61, 35))


def positions(lengths: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def token_batch(lengths: tuple[tuple[int, ...], ...]) -> TokenBatch:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (len(lengths), TOKENS), generator=generator)
    labels = ids.roll(-1, dims=1)
    starts = positions(lengths) == 0
    labels[starts.roll(-1, dims=1)] = -100  # the last token of a document predicts nothing
    return TokenBatch(ids, positions(lengths), labels)


def model_pair(lora: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    register_attention()
    model = build_tiny_model(tiny_llama_config(VOCAB), seed=0)
    if lora:
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
            model = get_peft_model(model, config)
    return model, copy.deepcopy(model)


def loss_and_grads(model: torch.nn.Module, backend: LocalBackend, batch: TokenBatch):
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation(backend.attn_implementation)
    sharded = backend.shard(batch)
    loss, _ = logits_loss(model, sharded.model_kwargs, sharded.shift_labels)
    loss.backward()
    if sharded.call is not None:
        check_layers_served(sharded.call, 2)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": loss.detach(), **grads}


class SquareTensors(TorchDispatchMode):
    """Records every tensor an operation returns with two dimensions of ``tokens`` (a row's mask or scores)."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens = tokens
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and list(t.shape).count(self.tokens) >= 2:
                self.seen.append((str(func), tuple(t.shape)))
        return out


CASES = [
    pytest.param(
        causal, lengths, lora, id=f"{'causal' if causal else 'bidir'}-{name}-{'lora' if lora else 'full'}"
    )
    for causal in (True, False)
    for name, lengths in (("packed", PACKED_LENGTHS), ("unpacked", UNPACKED_LENGTHS))
    for lora in (True, False)
]


@pytest.mark.parametrize(("causal", "lengths", "lora"), CASES)
def test_documents_give_the_masked_paths_losses_and_gradients(causal, lengths, lora):
    batch = token_batch(lengths)
    masked_model, documents_model = model_pair(lora)
    twin_models = [copy.deepcopy(masked_model) for _ in TOKEN_ORDER_TWINS]
    reference = loss_and_grads(masked_model, LocalBackend(causal), batch)
    got = loss_and_grads(documents_model, LocalBackend(causal, documents=True), batch)
    twins = [
        loss_and_grads(m, t.backend(causal), batch)
        for m, t in zip(twin_models, TOKEN_ORDER_TWINS, strict=True)
    ]
    ref64 = loss_and_grads(masked_model.double(), LocalBackend(causal), batch)
    # Twins rule: every fp32 path computes the same attention with sums in other orders (a document's keys
    # alone, or the whole row's with masked-out terms exactly 0, its tokens in their order or 2 others: the
    # reference and its twins).
    assert_float64_twins_rule(got, [reference, *twins], ref64, what=f"causal={causal} lora={lora}")


@pytest.mark.parametrize("causal", [True, False])
def test_documents_never_build_a_tokens_by_tokens_tensor(causal):
    batch = token_batch(PACKED_LENGTHS)
    masked_model, documents_model = model_pair(lora=True)
    with SquareTensors(TOKENS) as masked:
        loss_and_grads(masked_model, LocalBackend(causal), batch)
    # The detector sees the masked path's mask (it would see the documents path's too).
    assert masked.seen, "the masked path built no tokens x tokens tensor: the detector is blind"
    with SquareTensors(TOKENS) as documents:
        loss_and_grads(documents_model, LocalBackend(causal, documents=True), batch)
    assert documents.seen == []


def local_plan(write_recipe, tmp_path, recipe_keys=None, **config_overrides):
    """The attention a cp=1 run of a tiny Llama (its config overridden, the recipe given ``recipe_keys``) plans."""
    import json
    import shutil

    from cptune.config.loader import load_recipe
    from cptune.models.loading import model_config
    from cptune.parallel.backends.local.runtime import RUNTIME
    from cptune.parallel.layout import ParallelDims

    recipe = load_recipe(write_recipe())
    model_dir = tmp_path / "model"
    shutil.copytree(recipe.base_model, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **config_overrides}))
    recipe = load_recipe(write_recipe(base_model=str(model_dir), **(recipe_keys or {})))
    plan = RUNTIME.plan(recipe, ParallelDims(world_size=1, cp_size=1), 0, model_config(recipe))
    return plan.attn_implementation, plan.build(None, None)


def test_a_packed_cp1_run_of_a_full_attention_model_attends_document_by_document(write_recipe, tmp_path):
    implementation, sharder = local_plan(write_recipe, tmp_path)
    assert implementation == "cptune" and sharder.documents and sharder.kv_heads_per_call is None
    _, sharder = local_plan(write_recipe, tmp_path / "switch", recipe_keys={"attention_kv_heads_per_call": 1})
    assert sharder.kv_heads_per_call == 1  # the recipe's switch reaches the document attention


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(
            {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 16},
            id="window",
        ),
        pytest.param({"attention_dropout": 0.1}, id="attention-dropout"),
    ],
)
def test_a_model_cptunes_attention_cannot_serve_keeps_transformers_sdpa(write_recipe, tmp_path, overrides):
    implementation, sharder = local_plan(write_recipe, tmp_path, **overrides)
    assert implementation == "sdpa" and not sharder.documents


def test_rows_of_one_document_keep_one_sdpa_call_where_varlen_would_run(monkeypatch):
    """Unpacked rows go through one SDPA call over the batch (cuDNN's kernels on Hopper), packed ones through varlen.

    The varlen FlashAttention-2 call is what a GPU takes for rows of several documents; here it is
    stood in for, so the test sees which call a batch gets on any machine.
    """
    from cptune.parallel.backends import document_attention
    from cptune.parallel.kernels import varlen

    calls = []

    def stand_in(
        q, k, v, cu_seqlens, max_seqlen, scale=None, causal=True, window=None, kv_heads_per_call=None
    ):
        calls.append((cu_seqlens.tolist(), kv_heads_per_call))
        return q.clone()

    monkeypatch.setattr(document_attention, "varlen_runs", lambda q: True)
    monkeypatch.setattr(varlen, "varlen_attention", stand_in)
    attention = document_attention.DocumentAttention(causal=True)
    q, k, v = (torch.randn(2, 8, 4, 16) for _ in range(3))
    whole = torch.arange(8).expand(2, 8)
    out = attention.rows(q, k, v, None, whole)
    assert calls == []
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True
    )
    assert torch.equal(out, expected.transpose(1, 2))
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]).expand(2, 8)
    attention.rows(q, k, v, None, packed)
    document_attention.DocumentAttention(causal=True, kv_heads_per_call=2).rows(q, k, v, None, packed)
    assert calls == [([0, 3, 8, 11, 16], None), ([0, 3, 8, 11, 16], 2)]
