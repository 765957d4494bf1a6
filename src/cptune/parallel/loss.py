"""Token-weighted loss across context parallelism, data parallelism and accumulation.

Invariant 5: the gradient of an optimizer step equals that of

    Σ(token losses of the step, over every rank and micro batch) / (target tokens of the step)

whatever the CP size, DP size, micro batch or accumulation. Each rank therefore
returns ``local_sum · world_size / step_targets`` per micro batch: DDP averages
gradients over ``world_size`` processes and the Trainer sums micro batches, which
together give exactly the global token mean. The Trainer logs the mean over
processes of the summed returned values, which is the same global token mean.
A rank whose shard holds no target contributes a zero sum — never ``0/0``.
FSDP2 and DeepSpeed's engine (given no sequence-parallel group) average over
``world_size`` as DDP does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cptune.labels import IGNORE_INDEX
from cptune.parallel.backends.zero3_params import any_partitioned, partition_group
from cptune.parallel.collectives import all_reduce_max, all_reduce_sum
from cptune.parallel.row_gather import RowGather

# Logits above which the loss is computed in chunks (2**26: 256 MiB in fp32). At long context the
# logits are the largest tensors of a step: 16,384 tokens x Llama 3's 128,256 vocabulary is 8.4 GB
# in fp32, and cross-entropy keeps an fp32 log-softmax of that size for the backward, then makes
# an fp32 gradient of it. In chunks, each chunk's fp32 part is recomputed in the backward instead
# of kept, so only the logits themselves and their gradient stay whole.
LOSS_CHUNK_ELEMENTS = 1 << 26


Segments = tuple[torch.Tensor, int]
"""Per-token segment ids (shaped like the targets, in ``0..count-1`` wherever a token has a target) and ``count``:
a loss summed per segment instead of over all tokens (the sequences of preference pairs,
:mod:`cptune.parallel.preference`)."""


def token_loss_sum(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    chunk_elements: int = LOSS_CHUNK_ELEMENTS,
    segments: Segments | None = None,
) -> torch.Tensor:
    """Sum of next-token cross-entropy over target tokens, computed in fp32.

    Logits larger than ``chunk_elements`` are taken in chunks of whole tokens (see
    ``LOSS_CHUNK_ELEMENTS``). Each token's loss and gradient are the same either way; only
    the order in which the fp32 sum adds the tokens' losses differs.

    Args:
        logits: (..., tokens, vocab) logits for this rank's tokens.
        shift_labels: (..., tokens) targets already shifted per document; -100 = none.
        chunk_elements: Most logits per chunk.
        segments: Sum per segment instead: the result is a ``(count,)`` vector.
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = shift_labels.reshape(-1).to(logits.device)
    ids, count = _flat_segments(segments, logits.device)
    rows = max(1, chunk_elements // vocab)
    if flat_logits.shape[0] <= rows:
        return _cross_entropy_sum(flat_logits, flat_labels, ids, count)
    label_chunks = flat_labels.split(rows)
    id_chunks = ids.split(rows) if ids is not None else [None] * len(label_chunks)
    chunks = zip(flat_logits.split(rows), label_chunks, id_chunks, strict=True)
    if torch.is_grad_enabled() and flat_logits.requires_grad:
        # Keeps each chunk's input (a view of the logits) and recomputes its fp32 part in the backward.
        parts = [checkpoint(_cross_entropy_sum, x, y, i, count, use_reentrant=False) for x, y, i in chunks]
    else:
        parts = [_cross_entropy_sum(x, y, i, count) for x, y, i in chunks]
    return torch.stack(parts).sum(0)


def _flat_segments(segments: Segments | None, device: torch.device) -> tuple[torch.Tensor | None, int]:
    if segments is None:
        return None, 1
    ids, count = segments
    return ids.reshape(-1).to(device), count


def _cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor | None = None, count: int = 1
) -> torch.Tensor:
    if ids is None:
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    per_token = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    kept = labels != IGNORE_INDEX
    return per_token.new_zeros(count).index_add(0, ids[kept], per_token[kept])


def count_targets(shift_labels: torch.Tensor) -> torch.Tensor:
    """Number of target tokens (labels other than -100)."""
    return (shift_labels != IGNORE_INDEX).sum()


def step_target_count(
    local_count: torch.Tensor, copies: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Target tokens of the whole optimizer step across all data-parallel groups.

    ``local_count`` counts the micro batches this rank received for the step; the sum
    over all ranks counts each token ``copies`` times: ``cp_size`` when every rank of a
    CP group received the same full batches, 1 when each rank received its own shard.
    """
    total = all_reduce_sum(local_count.detach().to(torch.int64), group)
    if total.item() % copies:
        raise RuntimeError(
            "the ranks of a context-parallel group did not receive the same batches "
            f"(target count {total.item()} is not a multiple of the {copies} copies of each batch)"
        )
    return total // copies


def scaled_step_loss(
    loss_sum: torch.Tensor, step_targets: torch.Tensor, gradient_divisor: int
) -> torch.Tensor:
    """The value to backpropagate for one micro batch on one rank (see module docstring).

    ``gradient_divisor`` is what the gradient sum over all ranks is divided by: the world
    size (DDP, FSDP2 and cptune's DeepSpeed runs average over every rank).
    """
    targets = step_targets.to(loss_sum.device)
    if int(targets) == 0:
        # No target anywhere in the step: a zero loss that keeps the graph alive.
        return loss_sum * 0.0
    return loss_sum * (gradient_divisor / targets.to(loss_sum.dtype))


def head_token_loss_sum(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    shift_labels: torch.Tensor,
    vocab: int,
    chunk_elements: int = LOSS_CHUNK_ELEMENTS,
    *,
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    segments: Segments | None = None,
) -> torch.Tensor:
    """:func:`token_loss_sum` of ``head(norm(hidden))``, without ever holding more than one chunk of logits.

    Only the tokens with a target are projected, ``chunk_elements // vocab`` of them at a time;
    each chunk's rows, normalised rows, logits and fp32 cross-entropy are recomputed in the
    backward instead of kept (what fused linear cross-entropy kernels do, in plain torch), and the
    rows are gathered per chunk (:class:`cptune.parallel.row_gather.RowGather`), so the loss keeps
    nothing of the sequence's size but ``hidden`` itself until its backward, which hands back one
    gradient of ``hidden``'s size. A token's loss and its gradient are those of the unchunked
    computation up to rounding (the same sums, in matrix products of another shape); the head's
    and the norm's weight gradients are summed chunk by chunk and the loss sum adds the chunks'
    sums, so those may differ in the last bits.

    Args:
        head: The output layer (hidden -> logits), e.g. the model's ``lm_head`` module.
        hidden: (..., tokens, hidden) hidden states of this rank's tokens: the final ones, or
            those before ``norm``.
        shift_labels: (..., tokens) targets already shifted per document; -100 = none.
        vocab: Width of the head's output (logits per token).
        chunk_elements: Most logits per chunk.
        norm: The model's final norm, applied per chunk before the head (None: ``hidden`` is
            already normalised).
        segments: Sum per segment instead: the result is a ``(count,)`` vector.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = shift_labels.reshape(-1).to(hidden.device)
    positions = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)
    labels = flat_labels.index_select(0, positions)
    ids, count = _flat_segments(segments, hidden.device)
    ids = ids.index_select(0, positions) if ids is not None else None
    size = max(1, chunk_elements // vocab)
    # At least one (possibly empty) chunk: the head stays in the graph when no token has a target.
    id_chunks = ids.split(size) if ids is not None else [None] * len(labels.split(size))
    chunks = list(zip(positions.split(size), labels.split(size), id_chunks, strict=True)) or [
        (positions, labels, ids)
    ]
    group = partition_group(head) or partition_group(norm)
    if group is not None:
        # ZeRO-3 gathers the head's (and norm's) weight in every call and again in each recomputation:
        # a collective over the partition group, so every rank must call them as often. Ranks with
        # fewer targets (another shard, another data-parallel batch) add empty chunks.
        most = int(all_reduce_max(torch.tensor([len(chunks)]), group)[0])
        empty = (positions[:0], labels[:0], ids[:0] if ids is not None else None)
        chunks += [empty] * (most - len(chunks))
    modules = [m for m in (head, norm) if isinstance(m, torch.nn.Module)]
    recompute = torch.is_grad_enabled() and (
        flat.requires_grad or any(p.requires_grad for m in modules for p in m.parameters())
    )
    gather = RowGather()
    source = gather.track(flat) if recompute else flat
    if recompute:
        # ZeRO-3 frees the gathered weights after each call, before the recomputation's saved tensors
        # are compared with the forward's; its backward hooks gather the weights again for use.
        check = "none" if any(any_partitioned(m) for m in modules) else "default"
        parts = [
            checkpoint(
                _chunk_cross_entropy_sum,
                head,
                norm,
                gather,
                source,
                at,
                y,
                i,
                count,
                use_reentrant=False,
                determinism_check=check,
            )
            for at, y, i in chunks
        ]
    else:
        parts = [_chunk_cross_entropy_sum(head, norm, gather, source, at, y, i, count) for at, y, i in chunks]
    return torch.stack(parts).sum(0)


def _chunk_cross_entropy_sum(
    head: Callable[[torch.Tensor], torch.Tensor],
    norm: Callable[[torch.Tensor], torch.Tensor] | None,
    gather: RowGather,
    source: torch.Tensor,
    positions: torch.Tensor,
    labels: torch.Tensor,
    ids: torch.Tensor | None = None,
    count: int = 1,
) -> torch.Tensor:
    rows = gather.rows(source, positions)
    if norm is not None:
        rows = norm(rows)
    return _cross_entropy_sum(head(rows), labels, ids, count)
