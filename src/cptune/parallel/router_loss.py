"""The router's load-balancing (auxiliary) loss of a mixture-of-experts model, exact under context parallelism.

transformers' ``load_balancing_loss_func`` (Qwen3-MoE, Mixtral, ... in 5.23) computes, over every
router call of a forward (each MoE layer, each token of the batch)::

    aux = E · Σ_e (assigned_e / rows) · (probability_e / rows)

with ``assigned_e`` the number of top-k assignments to expert ``e``, ``probability_e`` the sum of the
router's softmax for ``e`` and ``rows`` the number of (layer, token) pairs; padding is left out only
when an ``attention_mask`` is given. It is a product of two means over the whole batch, so a
rank of a CP group, which sees a shard of the batch, cannot compute it alone, and the mean of
per-rank values is not it either. Each rank sums its own tokens (:func:`router_sums`), the sums
are all-reduced over the CP group (the probability sums differentiably: every shard's router gets
the whole loss's gradient), and every rank forms the same formula from the totals: the cp=1 value.

Which tokens count: every token of the micro batch as the model sees it at cp=1, which is what
transformers counts for cptune's batches (they carry no ``attention_mask``: packed rows use
``position_ids``, and ``load_balancing_loss_func`` with ``attention_mask=None`` pools all tokens of
all rows, packed documents and any collator padding alike). The padding CP adds to split a batch
evenly (row -1 in :class:`cptune.parallel.shard.TokenCoords`) is not at cp=1 and is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cptune.parallel.collectives import all_reduce_sum, differentiable_all_reduce_sum


@dataclass(frozen=True)
class RouterBalance:
    """A model's router load-balancing loss settings: ``coef · aux`` is added to the training loss.

    Read from the model's config (:meth:`from_config`), where transformers reads them:
    ``output_router_logits`` turns the term on, ``router_aux_loss_coef`` weights it.
    """

    coef: float
    num_experts: int
    top_k: int

    @classmethod
    def from_config(cls, config: Any) -> RouterBalance | None:
        """The settings of a model whose forward adds the router loss (None: it adds none)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
        if not getattr(text, "output_router_logits", False) or coef <= 0.0:
            return None
        # Qwen3-MoE and gpt-oss name the expert count num_experts (or num_local_experts), Mixtral num_local_experts.
        num_experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
        top_k = getattr(text, "num_experts_per_tok", None)
        if not num_experts or not top_k:
            raise ValueError(
                f"{type(config).__name__} asks for a router loss (output_router_logits) but names no expert "
                "count (num_experts / num_local_experts) or num_experts_per_tok"
            )
        return cls(coef=coef, num_experts=int(num_experts), top_k=int(top_k))


@dataclass
class RouterSums:
    """One rank's part of the router loss: per-expert sums over its (layer, token) pairs, and their count."""

    assigned: torch.Tensor  # (experts,) top-k assignments; no gradient
    probability: torch.Tensor  # (experts,) router softmax; carries the gradient
    rows: torch.Tensor  # ()


def router_sums(
    router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int, keep: torch.Tensor | None = None
) -> RouterSums:
    """Per-expert sums of this rank's router calls (each layer's ``(tokens, experts)`` logits).

    ``keep`` (one bool per token, in the order of the logits' rows) drops tokens; None keeps all.
    The softmax and top-k are those of transformers' ``load_balancing_loss_func`` (in the logits'
    dtype, summed in fp32, or float64 for float64 logits).
    """
    device = router_logits[0].device
    # fp32 as transformers sums; a float64 model (a test's reference) in float64.
    dtype = torch.promote_types(router_logits[0].dtype, torch.float32)
    assigned = torch.zeros(num_experts, dtype=dtype, device=device)
    probability = torch.zeros(num_experts, dtype=dtype, device=device)
    tokens = router_logits[0].shape[0]
    weight = (
        torch.ones(tokens, dtype=dtype, device=device) if keep is None else keep.reshape(-1).to(device, dtype)
    )
    rows = torch.zeros((), dtype=dtype, device=device)
    for logits in router_logits:
        probs = F.softmax(logits, dim=-1)
        _, experts = torch.topk(probs, top_k, dim=-1)
        counts = weight.repeat_interleave(top_k)
        assigned = assigned + torch.zeros_like(assigned).scatter_add_(0, experts.reshape(-1), counts)
        probability = probability + (probs.to(dtype) * weight.unsqueeze(-1)).sum(0)
        rows = rows + weight.sum()
    return RouterSums(assigned=assigned, probability=probability, rows=rows)


def balance_loss(sums: RouterSums, num_experts: int) -> torch.Tensor:
    """``E · Σ_e (assigned_e / rows) · (probability_e / rows)``: the loss of the tokens the sums cover."""
    if float(sums.rows) == 0.0:
        return sums.probability.sum() * 0.0  # no token anywhere: zero, with the graph kept
    return num_experts * torch.sum((sums.assigned / sums.rows) * (sums.probability / sums.rows))


def router_balance_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    keep: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The router loss of the whole micro batch of a CP group, the same value on every rank of it.

    Args:
        router_logits: This rank's router logits, one ``(tokens, experts)`` tensor per MoE layer.
        num_experts: Experts per layer.
        top_k: Experts each token is routed to.
        keep: One bool per token of this rank: False for the padding CP added (None: keep all).
        group: The CP group whose ranks hold the batch's shards; None when this rank holds it whole.
    """
    sums = router_sums(router_logits, num_experts, top_k, keep)
    if group is not None:
        sums = RouterSums(
            assigned=all_reduce_sum(sums.assigned, group),
            probability=differentiable_all_reduce_sum(sums.probability, group),
            rows=all_reduce_sum(sums.rows, group),
        )
    return balance_loss(sums, num_experts)
