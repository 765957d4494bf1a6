"""Memory features at cp=1, each on against off: activation offloading, tiled MLP, the chunked head loss.

One tiny Llama (2 layers) with gradient checkpointing, LoRA (every linear layer) or a full fine-tune,
fp32, two rows of 40 tokens with prompt tokens masked; the same seeds with the feature on and off.

- Offloading is exact: losses and gradients are bit for bit the same (torch.equal).
- Tiled MLP and head loss: the same sums in another order (weight gradients summed over tiles, token
  losses over chunks, products of other shapes). Each is checked against a float64 reference of the
  untiled model (tests/numerics.py, the twins rule): per tensor at most 32x as far from it as the
  farthest of the untiled fp32 run and its 2 twins (the same run with attention's tokens in other
  orders, tests/parallel/reorder_twins.py's ``TOKEN_ORDER_TWINS``) lands, plus 2 ulps (161x or 2.6e4x where
  only 2 or 1 of the fp32 tensors are distinct: tests/numerics.py's ``TWINS_FACTORS``); the loss, counted by the
  draws its gradients show and known to within its last rounding, plus the bound of its sum of token losses.

CP parity with the features on (cp=2, every backend) runs in tests/parallel/test_parity.py and
tests/parallel/test_ulysses_parity.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cptune.errors import CptuneError
from cptune.models.head_loss import HeadLoss, check_head_loss_supported, logits_loss
from cptune.models.offload import ActivationOffloader, enable_activation_offloading
from cptune.models.tiled_mlp import decoder_mlps, enable_tiled_mlp, tiled_mlp
from cptune.parallel.shard import TokenBatch
from devtools.tiny import build_tiny_model, tiny_llama_config
from tests import reorder
from tests.numerics import (
    assert_float64_twins_rule,
    assert_within,
    distinct_draws,
    draws_per_tensor,
    excess,
    float64_logits_loss,
    float64_loss_sum,
    float64_scalar_twins_excess,
    loss_sum_floor,
    relative_error,
    reorder_bound,
)
from tests.parallel.reorder_twins import TOKEN_ORDER_TWINS
from tests.token_orders import TWIN_ORDERS, assert_distinct_draws, assert_legal_twin, token_order

VOCAB, TOKENS = 97, 40
TARGETS = 2 * (TOKENS - 6)  # batch(): per row 5 prompt tokens and the last one have no target


def build(
    lora: bool, checkpointing: bool = True, targets="all-linear", dtype: torch.dtype | None = None, **config
):
    """The tiny Llama (in ``dtype``; its LoRA adapters as peft makes them), checkpointed unless told not to."""
    model = build_tiny_model(tiny_llama_config(VOCAB, **config), seed=1)
    if dtype is not None:
        model = model.to(dtype)
    model.config.use_cache = False
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        model = get_peft_model(model, config)
    return model


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, TOKENS), generator=generator)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[:, :5] = -100  # a prompt
    return {"input_ids": ids, "position_ids": torch.arange(TOKENS).expand(2, TOKENS)}, labels


def step(model, loss_fn=logits_loss, inputs: tuple[dict, torch.Tensor] | None = None):
    """The loss and the gradients of one backward of ``inputs`` (model kwargs, shift labels; :func:`batch`'s)."""
    model.zero_grad(set_to_none=True)
    kwargs, labels = batch() if inputs is None else inputs
    loss, _ = loss_fn(model, kwargs, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def twin_steps(lora: bool, **config) -> list:
    """``step`` of the model ``build`` gives, through each of ``TOKEN_ORDER_TWINS`` (cptune's masked SDPA, the tokens
    in another order): the twins of the untiled fp32 run, the same function with attention's sums in other orders."""
    from cptune.parallel.backends.attention import register_attention

    register_attention()
    kwargs, labels = batch()
    steps = []
    for twin in TOKEN_ORDER_TWINS:
        backend = twin.backend(causal=True)
        model = build(lora, **config)
        model.set_attn_implementation(backend.attn_implementation)
        sharded = backend.shard(TokenBatch(kwargs["input_ids"], kwargs["position_ids"], labels))
        steps.append(step(model, inputs=(sharded.model_kwargs, sharded.shift_labels)))
    return steps


def float64_step(lora: bool, **config):
    """``step`` of the same model in float64, the loss too: the reference of the float64-reference rule."""
    return step(build(lora, **config).double(), float64_logits_loss)


def assert_near_float64(got, references, ref64, what: str) -> None:
    """``got`` (loss, gradients) within the twins rule, the fp32 run and its twins ``references`` setting the scale.

    The loss is a sum of TARGETS positive token losses: its floor is that sum's reorder bound.
    """
    error, *reference_errors = (relative_error(x[0], ref64[0]) for x in (got, *references))
    draws = max(
        draws_per_tensor([r[1] for r in references]).values()
    )  # the loss's: its orders can round alike
    assert float64_scalar_twins_excess(error, reference_errors, loss_sum_floor(TARGETS), draws) <= 1, (
        what,
        error,
        reference_errors,
    )
    assert_float64_twins_rule(got[1], [r[1] for r in references], ref64[1], what=what)


@pytest.mark.parametrize(("lora", "chunk_bytes"), [(True, 4096), (False, 64 << 20)], ids=["lora", "full"])
def test_offloading_is_bit_exact_and_moves_only_the_checkpoint_inputs(lora, chunk_bytes, monkeypatch):
    """Also in host chunks of 4 KiB (a layer input here is 40 KiB): the chunks go back in order."""
    from cptune.models import offload

    monkeypatch.setattr(offload, "PINNED_CHUNK_BYTES", chunk_bytes)
    loss, grads = step(build(lora))
    model = build(lora)
    offloader = enable_activation_offloading(model)
    offloaded_loss, offloaded_grads = step(model)
    assert torch.equal(offloaded_loss, loss)
    assert all(torch.equal(offloaded_grads[n], g) for n, g in grads.items())
    # One tensor per layer, each a layer's input: 2 rows x 40 tokens x hidden 64 in fp32.
    stats = offloader.stats
    assert (stats.packed, stats.unpacked, stats.prefetched) == (2, 2, 1)
    assert stats.peak_host_bytes == 2 * (2 * TOKENS * 64 * 4)
    assert stats.host_bytes == 0  # all released after the backward


def test_offloading_needs_checkpointing_and_refuses_reentrant():
    with pytest.raises(ValueError, match="needs gradient checkpointing"):
        enable_activation_offloading(build(lora=False, checkpointing=False))
    with pytest.raises(ValueError, match="non-reentrant"):
        ActivationOffloader()(torch.sin, torch.ones(2, requires_grad=True), use_reentrant=True)


def test_host_buffers_are_not_device_memory_on_cpu():
    """On CPU the host copies come from numpy: torch's allocator (the device-side count) never sees them."""
    from benchmarks.memtrace import AllocationTrace

    from cptune.models.offload import _host_buffer

    like = torch.ones(1024, 64)
    with AllocationTrace() as host:
        buffer = _host_buffer(like, pinned=False)
        buffer.copy_(like)
    with AllocationTrace() as device:
        copy = torch.empty_like(like)
    assert host.result.peak == 0 and device.result.peak == copy.numel() * 4
    assert torch.equal(buffer, like)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_tiled_mlp_matches_untiled_up_to_summation_order(lora):
    untiled = step(build(lora))
    model = build(lora)
    hooks = enable_tiled_mlp(model, num_shards=reorder.tiles(3))
    assert len(hooks) == 2
    tiled = step(model)
    # Float64 reference: the tiles add each weight's gradient in another order, and a BLAS may
    # round a product of 27 rows unlike one of 80.
    assert_near_float64(tiled, [untiled, *twin_steps(lora)], float64_step(lora), "tiled MLP")
    for hook in hooks:
        hook.remove()
    loss, grads = step(model)  # hooks off: the model computes as before, the same operations
    assert torch.equal(loss, untiled[0]) and all(torch.equal(grads[n], g) for n, g in untiled[1].items())


def test_tiled_mlp_replays_dropout_in_the_backward():
    """Each tile's recomputation draws the masks its forward drew: the gradient of what was computed."""
    tiles = reorder.tiles(3)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 8))
    x = torch.randn(2, 12, 8, requires_grad=True)
    params = list(mlp.parameters())
    torch.manual_seed(1)
    expected = torch.cat([mlp(tile) for tile in x.tensor_split(tiles, dim=-2)], dim=-2)
    expected.square().sum().backward()
    reference = [x.grad.clone()] + [p.grad.clone() for p in params]
    x.grad = None
    mlp.zero_grad()
    torch.manual_seed(1)
    out = tiled_mlp(mlp, x, tiles, params)
    assert torch.equal(out, expected)
    after_forward = torch.get_rng_state()
    out.square().sum().backward()
    assert torch.equal(torch.get_rng_state(), after_forward)  # the replay leaves the caller's RNG alone
    # Bound: both add the same products, the tiles' weight gradients in another order (and a BLAS
    # may block a tile's products differently). The chain: 24 tokens, 8 inputs, 16 hidden, 8 outputs.
    bound = [reorder_bound(24 + 8 + 16 + 8, m) for m in absolute_gradients(mlp, x, p=0.5)]
    got = [x.grad] + [p.grad for p in params]
    names = ["x"] + [name for name, _ in mlp.named_parameters()]
    for name, g, want, limit in zip(names, got, reference, bound, strict=True):
        assert_within(g, want, limit, f"gradient of {name}")
    # Masks drawn anew in the backward instead of replayed fall outside the bound.
    torch.manual_seed(2)
    mlp.zero_grad()
    x.grad = None
    torch.cat([mlp(tile) for tile in x.tensor_split(tiles, dim=-2)], dim=-2).square().sum().backward()
    redrawn = [x.grad] + [p.grad for p in params]
    assert min(excess(g, want, limit) for g, want, limit in zip(redrawn, reference, bound, strict=True)) > 1
    # Each tile's output lands where its tokens are, with and without grad, in tiles of unequal sizes too
    # (5 tiles of 12 tokens: 3, 3, 2, 2, 2): the same bytes as concatenating the tiles' outputs.
    for count in (tiles, 5):
        torch.manual_seed(3)
        concatenated = torch.cat([mlp(tile) for tile in x.tensor_split(count, dim=-2)], dim=-2)
        for grad in (True, False):
            torch.manual_seed(3)
            with torch.set_grad_enabled(grad):
                assert torch.equal(tiled_mlp(mlp, x, count, params), concatenated), (count, grad)


def absolute_gradients(mlp: torch.nn.Sequential, x: torch.Tensor, p: float) -> list[torch.Tensor]:
    """Gradients of x and of the parameters of ``mlp`` (Linear, Dropout, Linear) on absolute values, in float64.

    Every weight and input non-negative and every dropout mask at its largest (1 / (1 - p)): each
    element majorizes the Σ|terms| of the chain of sums behind the gradient of ``out.square().sum()``.
    """
    layers = [copy.deepcopy(mlp[0]).double(), copy.deepcopy(mlp[2]).double()]
    with torch.no_grad():
        for weight in (w for layer in layers for w in layer.parameters()):
            weight.abs_()
    x_abs = x.detach().double().abs().requires_grad_()
    out = layers[1](layers[0](x_abs) / (1 - p))
    out.backward(2 * out.detach())  # |2 out| of the real MLP is at most this
    return [x_abs.grad] + [w.grad for layer in layers for w in layer.parameters()]


def test_tiled_mlp_refuses_a_mixture_of_experts():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(config)
    with pytest.raises(
        ValueError, match="mixture of experts: the tiles run under no_grad, so the router logits"
    ):
        decoder_mlps(model)


@pytest.mark.parametrize(
    ("lora", "targets", "tied"),
    [
        (True, "all-linear", False),
        (False, None, False),
        (True, ["q_proj", "lm_head"], False),
        (False, None, True),
    ],
    ids=["lora", "full", "lora-on-lm-head", "full-tied-embeddings"],
)
def test_head_loss_matches_the_logits_loss(lora, targets, tied):
    whole = step(build(lora, targets=targets, tie_word_embeddings=tied))
    model = build(lora, targets=targets, tie_word_embeddings=tied)
    head_loss = HeadLoss(model)
    chunked = step(model, head_loss)
    # Float64 reference: the chunks add the token losses in another order.
    ref64 = float64_step(lora, targets=targets, tie_word_embeddings=tied)
    twins = twin_steps(lora, targets=targets, tie_word_embeddings=tied)
    assert_near_float64(chunked, [whole, *twins], ref64, "head loss")
    if targets and "lm_head" in targets:
        assert any("lm_head.lora_B" in n for n in whole[1])


def test_head_loss_never_holds_more_than_a_chunk_of_logits():
    """Chunks of 3 tokens: the head sees 3 tokens at a time, with the loss and gradients of one chunk."""
    from cptune.parallel.loss import head_token_loss_sum

    model = build(lora=False, checkpointing=False)
    head = model.get_output_embeddings()
    kwargs, labels = batch()
    hidden = model.model(**kwargs).last_hidden_state.detach().requires_grad_()
    whole = head_token_loss_sum(head, hidden, labels, VOCAB)
    (whole_grad,) = torch.autograd.grad(whole, hidden)
    rows = []
    handle = head.register_forward_hook(lambda module, args, out: rows.append(out.shape[0]))
    small = head_token_loss_sum(head, hidden, labels, VOCAB, chunk_elements=3 * VOCAB)
    (small_grad,) = torch.autograd.grad(small, hidden)
    handle.remove()
    targets = int((labels != -100).sum())  # 68: 22 chunks of 3 and one of 2, each run again in the backward
    assert sorted(rows) == sorted(2 * ([3] * (targets // 3) + [targets % 3]))
    # Twins rule: the same sums, token losses added per chunk, products of another shape; the whole loss and
    # its 2 twins (the vocabulary in other orders) set the scale.
    head64 = copy.deepcopy(head).double()
    hidden64 = hidden.detach().double().requires_grad_()
    whole64 = float64_loss_sum(head64(hidden64), labels)
    (whole64_grad,) = torch.autograd.grad(whole64, hidden64)
    twins = [vocabulary_twin(head, hidden, labels, order) for order in TWIN_ORDERS]
    error, *reference_errors = (relative_error(x, whole64) for x in (small, whole, *(t[0] for t in twins)))
    references = [{"hidden": g} for g in (whole_grad, *(t[1] for t in twins))]
    draws = distinct_draws([r["hidden"] for r in references])  # the loss's: its orders can round alike
    assert float64_scalar_twins_excess(error, reference_errors, loss_sum_floor(targets), draws) <= 1, (
        error,
        reference_errors,
    )
    assert_float64_twins_rule({"hidden": small_grad}, references, {"hidden": whole64_grad})
    assert_distinct_draws(references, "the hidden gradient's vocabulary twins")  # each a draw of its own
    for order, (twin_loss, twin_grad) in zip(TWIN_ORDERS, twins, strict=True):  # the twins are legal
        twin64 = dict(
            zip(("loss", "hidden"), vocabulary_twin(head64, hidden64, labels, order, True), strict=True)
        )
        ref64 = {"loss": whole64.detach(), "hidden": whole64_grad}
        assert_legal_twin(
            twin64, ref64, {"loss": twin_loss, "hidden": twin_grad}, {"loss": whole, "hidden": whole_grad}
        )


def vocabulary_twin(
    head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, order: str, in_float64=False
):
    """``head_token_loss_sum`` of ``head`` and its gradient of ``hidden`` (``float64_loss_sum`` if ``in_float64``),
    the vocabulary taken in ``order`` (tests/token_orders.py): the head's rows in that order and the labels renamed
    to match, the same function with its sums over the vocabulary (the softmax's, the hidden gradient's) in
    another order."""
    from cptune.parallel.loss import head_token_loss_sum

    vocabulary = token_order(VOCAB, order)
    renamed = torch.where(labels == -100, labels, torch.argsort(vocabulary)[labels.clamp_min(0)])
    weight = head.weight.detach()[vocabulary]
    leaf = hidden.detach().requires_grad_()
    if in_float64:
        loss = float64_loss_sum(torch.nn.functional.linear(leaf, weight), renamed)
    else:
        loss = head_token_loss_sum(lambda h: torch.nn.functional.linear(h, weight), leaf, renamed, VOCAB)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def test_head_loss_refuses_a_model_that_transforms_its_logits():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, final_logit_softcapping=30.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"final_logit_softcapping: 30\.0"):
        check_head_loss_supported(config, Gemma2ForCausalLM)
    # The per-step check catches what the config check does not know about.
    config.final_logit_softcapping = None
    model = Gemma2ForCausalLM(config)
    head_loss = HeadLoss(model)
    model.config.final_logit_softcapping = 30.0
    ids = torch.randint(0, 32, (1, 6))
    with pytest.raises(CptuneError, match="cut_cross_entropy: the model's logits are not its output layer"):
        head_loss(model, {"input_ids": ids}, ids)


def test_head_loss_refuses_a_model_that_ignores_logits_to_keep():
    """Without a final ``norm`` to narrow (GPT-2's is ``ln_f``), such a model computes every logit: refused."""
    from transformers import GPT2Config, GPT2LMHeadModel

    class AllLogits(GPT2LMHeadModel):  # remote code that accepts the argument and ignores it
        def forward(self, *args, logits_to_keep=0, **kwargs):
            return super().forward(*args, **kwargs)

    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=TOKENS, eos_token_id=2)
    model = AllLogits(config)
    kwargs, labels = batch()
    head_loss = HeadLoss(model)
    assert head_loss.norm is None
    with pytest.raises(
        CptuneError, match="cut_cross_entropy: the model ignored logits_to_keep and computed 40"
    ):
        head_loss(model, {"input_ids": kwargs["input_ids"]}, labels)


def test_head_loss_refuses_a_decoder_that_changes_its_norms_output():
    """The chunks run the decoder's final norm themselves: a decoder that does more after it, or calls it
    again, is stopped at the first step."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    kwargs, labels = batch()
    model = build(lora=False, checkpointing=False)
    # Registered before the chunked loss's own hook, which therefore sees the changed output.
    model.model.register_forward_hook(
        lambda module, args, out: BaseModelOutputWithPast(last_hidden_state=out.last_hidden_state * 2)
    )
    with pytest.raises(CptuneError, match="cut_cross_entropy: the decoder's output is not its final norm's"):
        HeadLoss(model)(model, kwargs, labels)
    model = build(lora=False, checkpointing=False)
    head_loss = HeadLoss(model)

    def norm_again(module, args, out):
        module.norm(out.last_hidden_state)

    model.model.register_forward_hook(norm_again)
    with pytest.raises(CptuneError, match="cut_cross_entropy: the decoder called its final norm 2 times"):
        head_loss(model, kwargs, labels)


def test_head_loss_gives_the_final_norm_one_token():
    """The model's final norm computes the last token only, even for a model that ignores logits_to_keep."""
    from transformers import LlamaForCausalLM

    class AllLogits(LlamaForCausalLM):
        def forward(self, *args, logits_to_keep=0, **kwargs):
            return super().forward(*args, **kwargs)

    model = AllLogits(tiny_llama_config(VOCAB))
    tokens = []
    model.model.norm.register_forward_hook(lambda module, args, out: tokens.append(args[0].shape[-2]))
    kwargs, labels = batch()
    head_loss = HeadLoss(model)
    loss, outputs = head_loss(model, kwargs, labels)
    assert tokens[0] == 1 and outputs.logits.shape[-2] == 1
    loss.backward()
    # Then the chunks: each target token once in the loss's forward and once recomputed in its backward.
    assert sum(tokens[1:]) == 2 * TARGETS


def test_check_memory_features_refuses_a_mixture_of_experts_before_loading():
    from transformers import Qwen2MoeConfig

    from cptune.config.loader import validate_recipe
    from cptune.models.memory_features import check_memory_features

    config = Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    recipe = validate_recipe({"base_model": "unused", "datasets": [{"path": "d.jsonl"}], "tiled_mlp": True})
    with pytest.raises(CptuneError) as refused:
        check_memory_features(recipe, config)
    message = str(refused.value)
    assert message.startswith("tiled_mlp: Qwen2MoeForCausalLM cannot be tiled (its MLP (Qwen2MoeSparse"), (
        message
    )
    # The reason: the router loss would read logits the tiles computed without gradient.
    assert "the router logits its load-balancing loss reads would carry no gradient" in message, message
