"""The value one rank backpropagates for one training micro batch: the token loss, plus a MoE model's router loss.

The token loss is scaled as :mod:`cptune.parallel.loss` says (invariant 5). A mixture-of-experts
model whose forward adds its router's load-balancing loss (``output_router_logits`` with a
``router_aux_loss_coef``) gets that term here too, since cptune computes the loss itself rather
than taking the model's: ``coef · aux / accumulation`` on every rank, with ``aux`` the micro batch's
loss over the whole CP group (:func:`cptune.parallel.router_loss.router_balance_loss`, the same value on
each of its ranks). The gradient: the all-reduce's backward hands each shard the sum of the ``C``
ranks' gradients and DDP averages over ``D · C`` ranks, so the step's gradient is that of
``coef ·`` the mean of ``aux`` over the step's micro batches and data-parallel groups; the Trainer's
logged loss (a mean over processes of the summed values) carries that same mean.

Weighting across micro batches: transformers computes ``aux`` per forward batch and adds
``coef · aux`` to that batch's loss; the Hugging Face Trainer (5.23) then neither divides it by the
accumulation steps (a model taking loss kwargs is "scaled for GA") nor leaves it unscaled over data
parallelism (``loss *= num_processes`` before DDP's mean), so its effective weight is
``coef · accumulation · dp``. cptune takes the mean instead, so ``router_aux_loss_coef`` means the same
at any accumulation and data parallelism; with one micro batch per step and one data-parallel
group both are ``coef · aux``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cptune.parallel.loss import scaled_step_loss
from cptune.parallel.router_loss import RouterBalance, router_balance_loss
from cptune.parallel.shard import TokenCoords


def training_loss(
    loss_sum: torch.Tensor,
    outputs: Any,
    coords: TokenCoords | None,
    *,
    step_targets: torch.Tensor,
    gradient_divisor: int,
    router: RouterBalance | None = None,
    accumulation: int = 1,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The value to backpropagate for one micro batch on this rank, and its router loss (None without one).

    Args:
        loss_sum: This rank's token loss sum (the shard loss's).
        outputs: The model's outputs for this rank's shard (its ``router_logits`` when ``router``).
        coords: Where the shard's tokens sit in the batch (CP padding: row -1); None: the whole batch.
        step_targets: Target tokens of the optimizer step over every rank (counted once).
        gradient_divisor: What the gradient sum over ranks is divided by (the world size).
        router: The model's router loss settings (:meth:`RouterBalance.from_config`), or None.
        accumulation: Micro batches in this optimizer step.
        cp_group: The CP group holding the batch's shards; None at cp=1.
    """
    loss = scaled_step_loss(loss_sum, step_targets, gradient_divisor)
    if router is None:
        return loss, None
    router_logits = getattr(outputs, "router_logits", None)
    if not router_logits:
        raise RuntimeError(
            "the model's config asks for a router loss (output_router_logits, router_aux_loss_coef) "
            "but its forward returned no router_logits"
        )
    if coords is None and cp_group is not None:
        raise RuntimeError(
            "the backend gives no token coordinates, so CP padding cannot be left out of the router loss"
        )
    keep = None if coords is None else coords.rows.reshape(-1) >= 0
    aux = router_balance_loss(router_logits, router.num_experts, router.top_k, keep, cp_group)
    return loss + (router.coef / accumulation) * aux.to(loss.dtype), aux.detach()
