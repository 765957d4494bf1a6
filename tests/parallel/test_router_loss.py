"""The router's load-balancing loss: transformers' formula, and exact from per-shard sums."""

from __future__ import annotations

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from cptune.parallel.router_loss import RouterSums, balance_loss, router_balance_loss, router_sums

EXPERTS, TOP_K = 4, 2


def _router_logits(tokens: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """Two layers' router logits for ``tokens`` tokens."""
    generator = torch.Generator().manual_seed(5)
    return tuple(torch.randn(tokens, EXPERTS, generator=generator, dtype=dtype) for _ in range(2))


def _add(a: RouterSums, b: RouterSums) -> RouterSums:
    return RouterSums(a.assigned + b.assigned, a.probability + b.probability, a.rows + b.rows)


def test_it_is_transformers_load_balancing_loss_with_and_without_a_mask():
    logits = _router_logits(30, torch.float32)  # transformers sums in fp32; the same sums in the same order
    mask = torch.ones(2, 15, dtype=torch.long)
    mask[1, 11:] = 0  # a padded tail, left out by transformers when given the attention mask
    torch.testing.assert_close(
        router_balance_loss(logits, EXPERTS, TOP_K), load_balancing_loss_func(logits, EXPERTS, TOP_K)
    )
    torch.testing.assert_close(
        router_balance_loss(logits, EXPERTS, TOP_K, keep=mask.reshape(-1).bool()),
        load_balancing_loss_func(logits, EXPERTS, TOP_K, attention_mask=mask),
    )


def test_the_sums_of_the_shards_give_the_whole_batchs_loss_and_a_mean_of_shard_losses_does_not():
    logits = _router_logits(30)
    whole = router_balance_loss(logits, EXPERTS, TOP_K)
    # Two shards of 14 and 16 tokens (uneven: a padded split), in float64 so the sums are exact enough
    # to compare at 1e-12 (30 x 2 summands of size <= 1, 2**-52 each).
    first = router_sums([x[:14] for x in logits], EXPERTS, TOP_K)
    second = router_sums([x[14:] for x in logits], EXPERTS, TOP_K)
    torch.testing.assert_close(balance_loss(_add(first, second), EXPERTS), whole, rtol=1e-12, atol=1e-12)
    mean_of_shards = (balance_loss(first, EXPERTS) + balance_loss(second, EXPERTS)) / 2
    assert abs(float(mean_of_shards - whole)) > 1e-3


def test_tokens_left_out_change_nothing_and_no_token_gives_zero_with_a_graph():
    logits = _router_logits(12)
    keep = torch.tensor([True] * 9 + [False] * 3)
    torch.testing.assert_close(
        router_balance_loss(logits, EXPERTS, TOP_K, keep=keep),
        router_balance_loss([x[:9] for x in logits], EXPERTS, TOP_K),
    )
    leaf = logits[0].clone().requires_grad_()
    none = router_balance_loss([leaf], EXPERTS, TOP_K, keep=torch.zeros(12, dtype=torch.bool))
    none.backward()
    assert float(none.detach()) == 0.0 and float(leaf.grad.abs().max()) == 0.0
