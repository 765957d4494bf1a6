"""A MoE model's training loss at cp=1 is transformers' own: the token mean plus ``coef ·`` the router loss."""

from __future__ import annotations

import torch

from cptune.labels import shift_labels_within_documents
from cptune.models.head_loss import logits_loss
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.loss import count_targets
from cptune.parallel.router_loss import RouterBalance
from cptune.parallel.shard import TokenBatch
from cptune.run.training.micro_loss import training_loss
from devtools.tiny import build_tiny_qwen3_moe

VOCAB = 97


def _packed_batch() -> TokenBatch:
    """Two rows of 24 tokens, each three packed documents, prompt tokens without targets."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 24), generator=generator)
    positions = torch.cat([torch.arange(n) for n in (7, 12, 5)]).expand(2, 24).clone()
    labels = ids.clone()
    labels[:, :2] = -100
    return TokenBatch(ids, positions, shift_labels_within_documents(labels, positions))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_a_moe_models_training_loss_is_transformers_loss_with_its_router_loss():
    model = build_tiny_qwen3_moe(VOCAB, seed=1)  # output_router_logits, router_aux_loss_coef 0.02
    model.train()
    batch = _packed_batch()

    # transformers: the token mean plus coef x load_balancing_loss_func over all 48 tokens (no attention_mask).
    expected = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        labels=batch.input_ids,
        shift_labels=batch.shift_labels,
        use_cache=False,
    )
    expected.loss.backward()
    expected_grads = _grads(model)
    assert float(expected.aux_loss.detach()) > 1.0  # a term of 0.02 x ~2, large against fp32 rounding

    # cptune, as CptuneTrainer computes one micro batch at cp=1 (one micro batch, one process).
    sharded = LocalBackend(causal=True).shard(batch)
    loss_sum, outputs = logits_loss(model, sharded.model_kwargs, sharded.shift_labels)
    loss, aux = training_loss(
        loss_sum,
        outputs,
        sharded.coords,
        step_targets=count_targets(batch.shift_labels),
        gradient_divisor=1,
        router=RouterBalance.from_config(model.config),
    )
    loss.backward()
    grads = _grads(model)

    # The same operations on the same tokens, the sums in another order: fp32 rounding of values ~5
    # (a few ulps, 2**-23 x 5 x a few) and of gradients relative to their largest element.
    torch.testing.assert_close(loss, expected.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(aux, expected.aux_loss.detach(), rtol=1e-6, atol=1e-6)
    assert expected_grads.keys() == grads.keys()
    for name, expected_grad in expected_grads.items():
        scale = float(expected_grad.abs().max())
        torch.testing.assert_close(grads[name], expected_grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
    router_grad = grads["model.layers.0.mlp.gate.weight"]
    assert float(router_grad.abs().max()) > 0  # the router is trained by the aux term


def test_the_router_loss_is_off_unless_the_config_turns_it_on():
    model = build_tiny_qwen3_moe(VOCAB, seed=1, output_router_logits=False)
    assert RouterBalance.from_config(model.config) is None
    model = build_tiny_qwen3_moe(VOCAB, seed=1, router_aux_loss_coef=0.0)
    assert RouterBalance.from_config(model.config) is None
    assert RouterBalance.from_config(build_tiny_qwen3_moe(VOCAB, seed=1).config) == RouterBalance(0.02, 4, 2)
