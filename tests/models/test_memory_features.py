"""Memory features at cp=1, each on against off: activation offloading, tiled MLP, the chunked head loss.

One tiny Llama (2 layers) with gradient checkpointing, LoRA (every linear layer) or a full fine-tune,
fp32, two rows of 40 tokens with prompt tokens masked; the same seeds with the feature on and off.

- Offloading is exact: losses and gradients are bit for bit the same (torch.equal).
- Tiled MLP: the loss is the same; weight gradients differ in summation order only. Measured max
  relative differences (largest over the parameters, 3 tiles): 4.7e-7 LoRA, 3.7e-7 full; tolerance 2e-6.
- Head loss: gradients measured bit-identical here, the loss sum 1e-7 relative apart (the chunks add
  the tokens' losses in another order); tolerance 1e-6.

CP parity with the features on (cp=2, every backend) runs in tests/parallel/test_parity.py and
tests/parallel/test_ulysses_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from cptune.errors import CptuneError
from cptune.models.head_loss import HeadLoss, check_head_loss_supported, logits_loss
from cptune.models.offload import ActivationOffloader, enable_activation_offloading
from cptune.models.tiled_mlp import decoder_mlps, enable_tiled_mlp, tiled_mlp
from devtools.tiny import build_tiny_model, tiny_llama_config

VOCAB, TOKENS = 97, 40
TILED_GRAD_TOL = 2e-6
HEAD_LOSS_TOL = 1e-6


def build(lora: bool, checkpointing: bool = True, targets="all-linear", **config):
    model = build_tiny_model(tiny_llama_config(VOCAB, **config), seed=1)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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


def step(model, loss_fn=logits_loss):
    model.zero_grad(set_to_none=True)
    kwargs, labels = batch()
    loss, _ = loss_fn(model, kwargs, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def max_rel(grads, reference) -> float:
    return max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in reference.items())


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
    loss, grads = step(build(lora))
    model = build(lora)
    hooks = enable_tiled_mlp(model, num_shards=3)
    assert len(hooks) == 2
    tiled_loss, tiled_grads = step(model)
    assert torch.equal(tiled_loss, loss)
    assert max_rel(tiled_grads, grads) <= TILED_GRAD_TOL
    for hook in hooks:
        hook.remove()
    assert max_rel(step(model)[1], grads) <= TILED_GRAD_TOL  # hooks off: the model is as before


def test_tiled_mlp_replays_dropout_in_the_backward():
    """Each tile's recomputation draws the masks its forward drew: the gradient of what was computed."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 8))
    x = torch.randn(2, 12, 8, requires_grad=True)
    params = list(mlp.parameters())
    torch.manual_seed(1)
    expected = torch.cat([mlp(tile) for tile in x.tensor_split(3, dim=-2)], dim=-2)
    expected.square().sum().backward()
    reference = [x.grad.clone()] + [p.grad.clone() for p in params]
    x.grad = None
    mlp.zero_grad()
    torch.manual_seed(1)
    out = tiled_mlp(mlp, x, 3, params)
    assert torch.equal(out, expected)
    after_forward = torch.get_rng_state()
    out.square().sum().backward()
    assert torch.equal(torch.get_rng_state(), after_forward)  # the replay leaves the caller's RNG alone
    for got, want in zip([x.grad] + [p.grad for p in params], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_tiled_mlp_refuses_a_mixture_of_experts():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(config)
    with pytest.raises(ValueError, match="mixture of experts"):
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
    loss, grads = step(build(lora, targets=targets, tie_word_embeddings=tied))
    model = build(lora, targets=targets, tie_word_embeddings=tied)
    head_loss = HeadLoss(model)
    chunked_loss, chunked_grads = step(model, head_loss)
    assert abs(float(chunked_loss - loss)) <= HEAD_LOSS_TOL * abs(float(loss))
    assert max_rel(chunked_grads, grads) <= HEAD_LOSS_TOL
    if targets and "lm_head" in targets:
        assert any("lm_head.lora_B" in n for n in grads)


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
    torch.testing.assert_close(small, whole, rtol=1e-6, atol=0)
    # Per token the same sums, in products of another shape: rounding only (measured 2.9e-9 absolute).
    torch.testing.assert_close(small_grad, whole_grad, rtol=1e-5, atol=1e-8)


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
    from transformers import LlamaForCausalLM

    class AllLogits(LlamaForCausalLM):  # remote code that accepts the argument and ignores it
        def forward(self, *args, logits_to_keep=0, **kwargs):
            return super().forward(*args, **kwargs)

    model = AllLogits(tiny_llama_config(VOCAB))
    kwargs, labels = batch()
    with pytest.raises(
        CptuneError, match="cut_cross_entropy: the model ignored logits_to_keep and computed 40"
    ):
        HeadLoss(model)(model, kwargs, labels)


def test_check_memory_features_refuses_a_mixture_of_experts_before_loading():
    from transformers import Qwen2MoeConfig

    from cptune.config.loader import validate_recipe
    from cptune.models.memory_features import check_memory_features

    config = Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    recipe = validate_recipe({"base_model": "unused", "datasets": [{"path": "d.jsonl"}], "tiled_mlp": True})
    with pytest.raises(
        CptuneError, match=r"tiled_mlp: Qwen2MoeForCausalLM cannot be tiled \(its MLP \(Qwen2MoeSparse"
    ):
        check_memory_features(recipe, config)
