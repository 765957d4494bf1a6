import math

import pytest
import torch

from cptune.parallel.loss import count_targets, scaled_step_loss, step_target_count, token_loss_sum
from tests.numerics import assert_within, reorder_bound


def test_token_loss_sum_matches_manual_sum_and_ignores_masked():
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 11)
    labels = torch.tensor([[3, -100, 4, 10, -100]])
    manual = sum(-torch.log_softmax(logits[0, i], -1)[labels[0, i]] for i in range(5) if labels[0, i] != -100)
    # Bound: 3 token losses, each a logsumexp of 11 logits less one: terms up to 2 max|logit| + log 11.
    limit = reorder_bound(11 + 3, 3 * (2 * logits.abs().max() + math.log(11)))
    assert_within(token_loss_sum(logits, labels), manual, limit)
    assert count_targets(labels).item() == 3


def test_zero_target_shard_contributes_zero_not_nan():
    logits = torch.randn(1, 4, 7, requires_grad=True)
    labels = torch.full((1, 4), -100)
    loss = scaled_step_loss(token_loss_sum(logits, labels), torch.tensor(10), gradient_divisor=2)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_step_without_any_target_gives_zero_loss():
    logits = torch.randn(1, 4, 7, requires_grad=True)
    labels = torch.full((1, 4), -100)
    loss = scaled_step_loss(token_loss_sum(logits, labels), torch.tensor(0), gradient_divisor=4)
    assert loss.item() == 0.0 and not math.isnan(loss.item())


def test_scaling_gives_global_token_mean_over_ranks():
    # Two ranks with 3 and 1 targets: DDP's mean of the scaled losses is the global mean.
    sums = [torch.tensor(6.0), torch.tensor(2.0)]
    scaled = [scaled_step_loss(s, torch.tensor(4), gradient_divisor=2) for s in sums]
    assert sum(scaled) / 2 == 8.0 / 4  # binary fractions: exact


def test_step_target_count_single_process_divides_by_cp():
    assert step_target_count(torch.tensor(10), copies=1).item() == 10
    with pytest.raises(RuntimeError, match="same batches"):
        step_target_count(torch.tensor(7), copies=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_equals_the_whole_loss_with_the_same_gradients(dtype):
    """Long logits are taken in chunks (fp32 part recomputed in the backward): same loss, same gradient."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 37, 50)).to(dtype)
    labels = torch.randint(0, 50, (2, 37))
    labels[0, :5] = -100
    labels[1, 30:] = -100

    def loss_and_grad(chunk_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = logits.clone().requires_grad_()
        loss = token_loss_sum(leaf, labels, chunk_elements=chunk_elements)
        loss.backward()
        return loss.detach(), leaf.grad

    whole_loss, whole_grad = loss_and_grad(chunk_elements=10**9)
    chunked_loss, chunked_grad = loss_and_grad(chunk_elements=7 * 50)  # chunks of 7 tokens, the last of 4
    # Bound: the same token losses (positive) added in another order, in fp32.
    limit = reorder_bound(int(count_targets(labels)), whole_loss)
    assert_within(chunked_loss, whole_loss, limit)
    assert torch.equal(chunked_grad, whole_grad)  # every token's gradient is computed alike
    with torch.no_grad():
        assert_within(token_loss_sum(logits, labels, chunk_elements=7 * 50), whole_loss, limit)
