"""Evaluation under context parallelism: the exact token mean over the whole evaluation set.

The Trainer's evaluation loop averages one loss per batch (and per process),
which under CP is a mean of per-rank, per-batch means: wrong whenever batches
or shards hold different numbers of target tokens, and ``cp_size`` times too
large when each rank's loss is scaled for training. cptune's loop keeps two
numbers per process instead, the sum of its shard's token losses and its
shard's target count, and all-reduces them once at the end:

    eval_loss = Σ token losses / Σ target tokens   (over every rank and batch)

A shard without targets adds 0 to both sums, never ``0/0``. Each data-parallel
group evaluates its own rows (every CP rank of a group the same rows), with no
row repeated to even out the groups (accelerate's ``even_batches`` would count
repeated rows twice); groups may therefore run different numbers of batches, so
nothing in a batch may be a collective over the whole world.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from cptune.errors import CptuneError


@dataclass(frozen=True)
class EvalTotals:
    """Summed token loss and target count of everything one process (or the world) evaluated."""

    loss_sum: float
    targets: int

    def metrics(self, prefix: str) -> dict[str, float]:
        """``{prefix}_loss`` (the token mean), ``{prefix}_perplexity`` and ``{prefix}_tokens``.

        Raises:
            CptuneError: no target token anywhere in the evaluation data.
        """
        if self.targets == 0:
            raise CptuneError(
                "evaluation: the evaluation data has no target tokens (every label is -100), so there is "
                "no loss to report. Check test_datasets / val_set_size and train_on_inputs."
            )
        loss = self.loss_sum / self.targets
        try:
            perplexity = math.exp(loss)
        except OverflowError:
            perplexity = math.inf
        return {f"{prefix}_loss": loss, f"{prefix}_perplexity": perplexity, f"{prefix}_tokens": self.targets}


def all_reduce_totals(loss_sum: torch.Tensor, targets: torch.Tensor, device: torch.device) -> EvalTotals:
    """Sum both totals over every process (one collective; fp64 so the order of summing does not matter)."""
    both = torch.stack([loss_sum.double(), targets.double()]).to(device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    return EvalTotals(loss_sum=float(both[0]), targets=round(float(both[1])))


def data_parallel_indices(num_rows: int, dp_size: int, dp_rank: int) -> list[int]:
    """Rows evaluated by data-parallel group ``dp_rank``: every ``dp_size``-th row, none twice."""
    return list(range(dp_rank, num_rows, dp_size))


def build_eval_dataloader(
    dataset: Any,
    *,
    batch_size: int,
    collate_fn: Callable,
    dp_size: int,
    dp_rank: int,
    num_workers: int = 0,
) -> DataLoader:
    """A data loader over this data-parallel group's share of ``dataset``, in order, nothing repeated."""
    if not isinstance(dataset, Sized):
        raise CptuneError(
            "evaluation: the evaluation data must have a length (a prepared, map-style dataset)."
        )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=data_parallel_indices(len(dataset), dp_size, dp_rank),
        collate_fn=collate_fn,
        num_workers=num_workers,
        drop_last=False,
    )


def evaluate_batches(
    batches: Any,
    local_loss: Callable[[dict[str, Any]], tuple[torch.Tensor, torch.Tensor]],
    on_batch: Callable[[], None] = lambda: None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's summed token loss (fp64) and target count over ``batches``.

    Args:
        batches: The batches this process evaluates.
        local_loss: ``batch -> (token loss sum, target count)`` of this rank's shard, under no_grad.
        on_batch: Called after each batch (progress reporting).
    """
    loss_sum = torch.zeros((), dtype=torch.float64)
    targets = torch.zeros((), dtype=torch.int64)
    with torch.no_grad():
        for batch in batches:
            batch_sum, batch_targets = local_loss(batch)
            loss_sum += batch_sum.detach().double().cpu()
            targets += batch_targets.detach().cpu().to(torch.int64)
            on_batch()
    return loss_sum, targets
