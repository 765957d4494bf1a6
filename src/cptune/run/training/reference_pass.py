"""``precompute_ref_log_probs``: the reference's log-prob sums of every training pair, in a first pass.

A full fine-tune has no adapter to disable, so its reference is the model as loaded, before any step.
Before training starts, every row of the prepared training data goes through that model once, under CP
like a training forward (:func:`cptune.parallel.preference.reference_log_probs`: each rank's shard,
completed over its CP group, no gradients); the sums become the rows' ``reference_logps`` column
(chosen, rejected of each pair of the row, in order), which the collator puts in every batch, and
:func:`~cptune.parallel.preference.pair_forward` then runs no reference forward.

The data-parallel groups split the rows: batch ``b`` (``micro_batch_size`` rows in the stored order)
goes to group ``b mod dp``, whose first CP rank writes its sums into a vector of every row's, summed
over the world (one all-reduce: every other entry is zero, so the sum is exact). Every rank ends with
every row's sums. They come from the weights as loaded (before a resume loads a checkpoint), so a resumed
run trains against the same reference; they are stored with the prepared data and read back by a later or
resumed run (:mod:`cptune.run.training.reference_cache`).

Every rank runs the same number of forwards (:func:`first_pass_schedule`): a group left without a batch
in the last round runs one again and keeps nothing. With the parameters sharded (FSDP2, ZeRO-3) each
forward gathers them from every rank, so a rank that stopped early would leave the others waiting.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cptune.parallel.backends.base import BatchSharder, step_context
from cptune.parallel.collectives import all_reduce_sum
from cptune.parallel.preference import PairBatch, reference_log_probs
from cptune.parallel.shard import TokenBatch

COLUMN = "reference_logps"
"""The prepared rows' column of precomputed reference sums."""


def row_pair_counts(rows: Any) -> list[int]:
    """Pairs in each prepared row (documents, counted from its ``position_ids`` restarts, over two)."""
    return [sum(1 for p in row["position_ids"] if p == 0) // 2 for row in rows]


def precompute_reference(
    rows: Any,
    collate: Callable[[list], dict[str, Any]],
    model: torch.nn.Module,
    sharder: BatchSharder,
    shard_loss: Callable[..., Any],
    *,
    rows_per_batch: int,
    dp_rank: int,
    dp_size: int,
    cp_group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None = None,
    reference_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    attention_layers: int | None = None,
    device: torch.device | None = None,
) -> list[list[float]]:
    """Every row's reference sums: ``[chosen_0, rejected_0, chosen_1, ...]`` per row, on every rank (a collective).

    Args:
        rows: The prepared training rows (a ``datasets.Dataset`` or a list), in their stored order.
        collate: The training collator.
        model: The model as loaded (the reference).
        sharder: This process's backend sharder.
        shard_loss: The training shard loss (per-sequence sums through ``segments``).
        rows_per_batch: Rows per forward (``micro_batch_size``).
        dp_rank: This rank's data-parallel group.
        dp_size: Data-parallel groups.
        cp_group: This rank's CP group; None at cp=1.
        tp_group: This rank's tensor-parallel group; None without tensor parallelism. Every rank of a CP group
            and of its TP groups computes the same sums: the first of them keeps them, so the world's sum
            counts each row once.
        reference_context: Entered around each forward (the adapter disabled, for LoRA).
        attention_layers: The model's attention layers, to check each forward went through the backend.
        device: Where the forwards run (default: where the model's first parameter is; a sharded model's
            may be offloaded to the CPU).
    """
    pairs = row_pair_counts(rows)
    schedule = first_pass_schedule(math.ceil(len(pairs) / rows_per_batch), dp_rank, dp_size)
    offsets = [0]
    for count in pairs:
        offsets.append(offsets[-1] + 2 * count)
    device = device if device is not None else next(model.parameters()).device
    sums = torch.zeros(offsets[-1], dtype=torch.float64, device=device)
    writes = all(group is None or dist.get_rank(group) == 0 for group in (cp_group, tp_group))
    was_training = model.training
    model.eval()  # no dropout: the reference of every step is the model without it
    try:
        for number, keep in schedule:
            start = number * rows_per_batch
            stop = min(start + rows_per_batch, len(pairs))
            batch = PairBatch.from_inputs(collate([rows[i] for i in range(start, stop)]))
            with step_context(sharder):
                values = reference_log_probs(
                    model,
                    sharder,
                    shard_loss,
                    _on(batch, device),
                    cp_group,
                    reference_context,
                    attention_layers,
                )
            if writes and keep:
                sums[offsets[start] : offsets[stop]] = values.to(sums)
    finally:
        model.train(was_training)
    flat = all_reduce_sum(sums).tolist()
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(pairs))]


def first_pass_schedule(batches: int, dp_rank: int, dp_size: int) -> list[tuple[int, bool]]:
    """The batches one data-parallel group runs in the first pass: ``(batch number, keep its sums)``.

    Group ``g`` keeps batches ``g, g + dp, ...``. Every group runs ``ceil(batches / dp)`` forwards: one left
    without a batch in the last round runs its first batch again (batch 0 when it has none) and keeps
    nothing, so sharded parameters, which every forward gathers from every rank, are gathered in step.
    """
    mine = list(range(dp_rank, batches, dp_size))
    rounds = math.ceil(batches / dp_size)
    filler = mine[0] if mine else 0
    return [(number, True) for number in mine] + [(filler, False)] * (rounds - len(mine))


def _on(batch: PairBatch, device: torch.device) -> PairBatch:
    tokens = batch.tokens
    moved = TokenBatch(
        input_ids=tokens.input_ids.to(device),
        position_ids=tokens.position_ids.to(device),
        shift_labels=tokens.shift_labels.to(device),
    )
    return PairBatch(moved, batch.sequence_ids.to(device), batch.pairs)


def with_reference_column(rows: Any, sums: Sequence[Sequence[float]]) -> Any:
    """``rows`` (a ``datasets.Dataset``) with the precomputed sums as :data:`COLUMN`."""
    if COLUMN in rows.column_names:
        rows = rows.remove_columns(COLUMN)
    return rows.add_column(COLUMN, [list(row) for row in sums])


class RowsAwaitingReference(torch.utils.data.Dataset):
    """The training rows, each with its precomputed sums as :data:`COLUMN` once :meth:`fill` has given them.

    A model whose parameters are sharded (FSDP2, ZeRO-3) can run the first pass only once the Trainer has
    prepared it, after the training data loader is built over this object: the sums arrive then, and every
    row read before is an error.
    """

    def __init__(self, rows: Any):
        self.rows = rows
        self._sums: list[list[float]] | None = None

    def fill(self, sums: Sequence[Sequence[float]]) -> None:
        """Give every row its sums (:func:`precompute_reference`'s result, in the rows' order)."""
        if len(sums) != len(self.rows):
            raise ValueError(f"{len(sums)} rows of reference sums for {len(self.rows)} training rows")
        self._sums = [list(row) for row in sums]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._sums is None:
            raise RuntimeError("a training row was read before the first pass computed its reference sums")
        return {**self.rows[index], COLUMN: self._sums[index]}
