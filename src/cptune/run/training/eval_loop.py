"""Evaluation under context parallelism: the exact token mean over the whole evaluation set.

The Trainer's evaluation loop averages one loss per batch (and per process),
which under CP is a mean of per-rank, per-batch means: wrong whenever batches
or shards hold different numbers of target tokens, and ``cp_size`` times too
large when each rank's loss is scaled for training. cptune's loop keeps two
numbers per process instead, the sum of its shard's token losses and its
shard's target count, and all-reduces them once at the end:

    eval_loss = Σ token losses / Σ target tokens   (over every rank and batch)

A shard without targets adds 0 to both sums, never ``0/0``. Each data-parallel
group evaluates its own rows (every CP rank of a group the same rows), none
twice. Every group still runs the same number of forward passes: a model
sharded with FSDP2 or ZeRO-3 gathers its weights from every rank in each
forward, so a group with one batch more would wait there for ever while the
others sit in the final all-reduce. Groups with fewer rows therefore evaluate
filler rows at the end, copies of a row with every target ignored, which add 0
to both sums (accelerate's ``even_batches`` would repeat real rows and count
them twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from cptune.errors import CptuneError
from cptune.labels import IGNORE_INDEX
from cptune.parallel.collectives import all_reduce_sum


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


def all_reduce_totals(loss_sum: torch.Tensor, targets: torch.Tensor) -> EvalTotals:
    """Sum both totals over every process (one collective; fp64 so the order of summing does not matter)."""
    both = all_reduce_sum(torch.stack([loss_sum.double(), targets.double()]))
    return EvalTotals(loss_sum=float(both[0]), targets=round(float(both[1])))


def data_parallel_indices(num_rows: int, dp_size: int, dp_rank: int) -> list[int]:
    """Rows evaluated by data-parallel group ``dp_rank``: every ``dp_size``-th row, none twice."""
    return list(range(dp_rank, num_rows, dp_size))


class EvalRows(TorchDataset):
    """One data-parallel group's evaluation rows, then filler rows up to ``length``.

    A filler row is row 0 of ``source`` with every label -100: it runs a forward pass
    like any row, but has no target, so it adds nothing to the loss or the target count.
    """

    def __init__(self, source: Any, indices: list[int], length: int):
        self.source = source
        self.indices = indices
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        if i < len(self.indices):
            return self.source[self.indices[i]]
        row = self.source[0]
        return {**row, "labels": [IGNORE_INDEX] * len(row["labels"])}


def build_eval_dataloader(
    dataset: Any,
    *,
    batch_size: int,
    collate_fn: Callable,
    dp_size: int,
    dp_rank: int,
    num_workers: int = 0,
) -> DataLoader:
    """A data loader over this data-parallel group's share of ``dataset``, in order, nothing repeated.

    Every group gets the same number of rows (fillers without targets at the end, see
    :class:`EvalRows`), so every rank runs the same number of batches.
    """
    if not isinstance(dataset, Sized):
        raise CptuneError(
            "evaluation: the evaluation data must have a length (a prepared, map-style dataset)."
        )
    rows_per_group = -(-len(dataset) // dp_size)
    return DataLoader(
        EvalRows(dataset, data_parallel_indices(len(dataset), dp_size, dp_rank), rows_per_group),
        batch_size=batch_size,
        shuffle=False,
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
