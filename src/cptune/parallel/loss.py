"""Token-weighted loss across context parallelism, data parallelism and accumulation.

Invariant 5: the gradient of an optimizer step equals that of

    Σ(token losses of the step, over every rank and micro batch) / (target tokens of the step)

whatever the CP size, DP size, micro batch or accumulation. Each rank therefore
returns ``local_sum · world_size / step_targets`` per micro batch: DDP averages
gradients over ``world_size`` processes and the Trainer sums micro batches, which
together give exactly the global token mean. The Trainer logs the mean over
processes of the summed returned values, which is the same global token mean.
A rank whose shard holds no target contributes a zero sum — never ``0/0``.

An engine that divides the gradient sum by something else passes that instead of
``world_size`` (DeepSpeed under Ulysses: the data-parallel size for ZeRO 0-2; see
``backends.deepspeed_ulysses.gradient_divisor``); the Trainer then rescales the
value it logs by ``world_size / divisor`` (``CptuneTrainer.training_step``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cptune.parallel.shard import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over target tokens, computed in fp32.

    Args:
        logits: (..., tokens, vocab) logits for this rank's tokens.
        shift_labels: (..., tokens) targets already shifted per document; -100 = none.
    """
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits.reshape(-1, vocab).float(),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_targets(shift_labels: torch.Tensor) -> torch.Tensor:
    """Number of target tokens (labels other than -100)."""
    return (shift_labels != IGNORE_INDEX).sum()


def step_target_count(
    local_count: torch.Tensor, cp_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Target tokens of the whole optimizer step across all data-parallel groups.

    ``local_count`` counts the full (unsharded) micro batches this rank received for
    the step. Every rank of a CP group received the same batches, so the sum over
    all ranks counts each token ``cp_size`` times.
    """
    total = local_count.detach().clone().to(torch.int64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    if total.item() % cp_size:
        raise RuntimeError(
            "the ranks of a context-parallel group did not receive the same batches "
            f"(target count {total.item()} is not a multiple of cp_size={cp_size})"
        )
    return total // cp_size


def scaled_step_loss(loss_sum: torch.Tensor, step_targets: torch.Tensor, world_size: int) -> torch.Tensor:
    """The value to backpropagate for one micro batch on one rank (see module docstring).

    ``world_size`` is what the gradient sum over all ranks is divided by: the world
    size under DDP, the engine's own divisor otherwise.
    """
    targets = step_targets.to(loss_sum.device)
    if int(targets) == 0:
        # No target anywhere in the step: a zero loss that keeps the graph alive.
        return loss_sum * 0.0
    return loss_sum * (world_size / targets.to(loss_sum.dtype))
