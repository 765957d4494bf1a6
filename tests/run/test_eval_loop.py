"""The evaluation arithmetic: a token mean over everything, shards without targets, DP row split."""

from __future__ import annotations

import math

import pytest
import torch

from cptune.errors import CptuneError
from cptune.run.training.eval_loop import (
    EvalTotals,
    all_reduce_totals,
    build_eval_dataloader,
    data_parallel_indices,
    evaluate_batches,
)


def test_the_loss_is_the_token_mean_not_a_mean_of_batch_means():
    # Two batches: 1 target with loss 4.0, and 3 targets with loss 1.0 each.
    batches = [(torch.tensor(4.0), torch.tensor(1)), (torch.tensor(3.0), torch.tensor(3))]
    loss_sum, targets = evaluate_batches(batches, lambda b: b)
    metrics = all_reduce_totals(loss_sum, targets).metrics("eval")
    assert metrics["eval_loss"] == pytest.approx(7.0 / 4)  # a mean of batch means would be 2.5
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(7.0 / 4))
    assert metrics["eval_tokens"] == 4


def test_a_shard_without_targets_adds_nothing_and_no_nan():
    batches = [(torch.tensor(0.0), torch.tensor(0)), (torch.tensor(6.0), torch.tensor(2))]
    loss_sum, targets = evaluate_batches(batches, lambda b: b)
    assert EvalTotals(float(loss_sum), int(targets)).metrics("eval")["eval_loss"] == 3.0


def test_no_target_anywhere_is_a_clear_error():
    with pytest.raises(CptuneError, match="no target tokens"):
        EvalTotals(0.0, 0).metrics("eval")


def test_huge_loss_gives_infinite_perplexity_not_an_overflow():
    assert EvalTotals(1e6, 1).metrics("eval")["eval_perplexity"] == math.inf


@pytest.mark.parametrize(("rows", "dp"), [(9, 2), (3, 4), (8, 4), (1, 1)])
def test_data_parallel_groups_split_the_rows_without_repeats(rows, dp):
    parts = [data_parallel_indices(rows, dp, rank) for rank in range(dp)]
    assert sorted(i for part in parts for i in part) == list(range(rows))


@pytest.mark.parametrize(("rows", "dp", "batch_size"), [(9, 2, 2), (3, 4, 1), (5, 2, 1), (8, 4, 3)])
def test_every_group_runs_the_same_number_of_batches_and_fillers_add_no_target(rows, dp, batch_size):
    """With FSDP2 or ZeRO-3 every forward gathers weights from all ranks: unequal counts deadlock."""
    from cptune.data.collator import PackedCollator
    from cptune.parallel.loss import count_targets

    data = [
        {"input_ids": [5] * (3 + i), "labels": [7] * (3 + i), "position_ids": list(range(3 + i))}
        for i in range(rows)
    ]
    collate = PackedCollator(pad_token_id=0)
    loaders = [
        build_eval_dataloader(data, batch_size=batch_size, collate_fn=collate, dp_size=dp, dp_rank=r)
        for r in range(dp)
    ]
    assert len({len(list(loader)) for loader in loaders}) == 1
    # The real rows are each evaluated once; the fillers contribute no target.
    targets = sum(int(count_targets(b["shift_labels"])) for loader in loaders for b in loader)
    assert targets == sum(2 + i for i in range(rows))
