"""Preference losses (DPO, IPO, ORPO, SimPO) under context parallelism, exact at every CP size.

The design (``docs/preference-training.md``, "How it works"): a pair is one row of two documents
(prompt + chosen, prompt + rejected) and the collator numbers the sequences of a batch
(:func:`cptune.labels.pair_sequence_ids`). Each rank sums the log-probabilities of the targets of
its own shard per sequence, with the same fp32 machinery as the SFT loss
(:func:`cptune.parallel.loss.token_loss_sum` and its chunked head variant, given ``segments``); a sum
all-reduce over the CP group completes the sums (:func:`~cptune.parallel.collectives.differentiable_all_reduce_sum`:
its backward adds the gradients of the group's ranks); each sequence's target count travels in the same
collective, so the per-token means (IPO, ORPO, SimPO) divide sums and counts of the same tokens. The
reference (DPO, IPO) is the same model with its adapter disabled, run on the same shard without gradients;
ORPO and SimPO read none. Every rank then computes the same
per-pair losses and backpropagates ``1/C`` of their sum, scaled as the SFT loss is
(:func:`preference_step_loss`), which gives the gradient of the mean over every pair of the
optimizer step.

Pure arithmetic (:class:`PreferenceLoss`, :class:`PairBatch`) apart from the one function that
runs the model and talks to the process group (:func:`pair_forward`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cptune.errors import CptuneError
from cptune.labels import IGNORE_INDEX
from cptune.parallel.backends.attention import check_layers_served
from cptune.parallel.collectives import all_reduce_sum, differentiable_all_reduce_sum
from cptune.parallel.loss import Segments, scaled_step_loss
from cptune.parallel.shard import TokenBatch, TokenCoords

if TYPE_CHECKING:
    from cptune.parallel.backends.base import BatchSharder, ShardedInputs

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""The metrics of preference training, as TRL's DPOTrainer names them; each a mean over pairs."""

EXTRA_METRICS = {
    "dpo": (),
    "ipo": (),
    "simpo": ("nll_loss",),
    "orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen"),
}
"""The metrics of each loss besides :data:`METRICS`, as TRL's CPOTrainer and ORPOTrainer name them.

``log_odds_ratio`` is the mean of ``log σ(log odds)`` and ``log_odds_chosen`` the mean of the log odds
themselves, as TRL's ORPOTrainer logs them; ``nll_loss`` is the chosen side's NLL (mean per token)."""


@dataclass(frozen=True)
class PairOutputs:
    """Per-pair results of one batch: the losses (with their graph) and, detached, what the metrics read."""

    losses: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Per pair, detached: the loss's :data:`EXTRA_METRICS`."""

    def metric_sums(self) -> dict[str, torch.Tensor]:
        """Each metric of the loss (:data:`METRICS` and its extras) summed over the batch's pairs (divide by the
        pairs for the mean)."""
        chosen, rejected = self.chosen_rewards, self.rejected_rewards
        values = (
            chosen,
            rejected,
            (chosen > rejected).to(chosen.dtype),
            chosen - rejected,
            self.chosen_logps,
            self.rejected_logps,
        )
        sums = {name: value.sum() for name, value in zip(METRICS, values, strict=True)}
        return sums | {name: value.sum() for name, value in self.extras.items()}


@dataclass(frozen=True)
class PreferenceLoss:
    """The per-pair loss of ``rl`` (``dpo``, ``ipo``, ``orpo`` or ``simpo``) with its parameters.

    With ``s = β·((π_c − ref_c) − (π_r − ref_r))`` over the sequences' log-prob sums: ``dpo`` is
    ``−(1 − ε)·log σ(s) − ε·log σ(−s)`` (TRL's ``sigmoid`` loss at ``ε = 0``); ``ipo`` is
    ``(x − 1/(2β))²`` with ``x`` the same log-ratio difference of per-token means (each side's sums
    divided by its target count), as TRL's ``ipo``. The rewards are ``β·(π − ref)`` of each side.

    ``orpo`` and ``simpo`` read no reference; with ``m`` each side's per-token mean log-prob, ``simpo`` is
    ``−log σ(β·(m_c − m_r) − γ) + α·(−m_c)`` (TRL's CPOTrainer with ``loss_type="simpo"``, ``α`` its
    ``cpo_alpha``) and ``orpo`` is ``−m_c − β·log σ(L)`` with the log odds
    ``L = (m_c − m_r) − (log(1 − e^m_c) − log(1 − e^m_r))`` (TRL's ORPOTrainer, ``β`` its λ); their rewards
    are ``β·m``. The NLL term ``−m_c`` is each pair's own mean over its chosen response's tokens, so the
    loss stays a mean over pairs (TRL takes the NLL as one mean over all the chosen tokens of its batch, and
    ORPOTrainer's over the prompt's tokens too: the same value for one pair of a batch; see
    docs/preference-training.md).
    """

    kind: str
    beta: float
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0

    @classmethod
    def from_recipe(cls, recipe: Any) -> PreferenceLoss:
        """The loss a validated recipe with ``rl`` asks for."""
        return cls(
            kind=recipe.rl,
            beta=recipe.resolved_beta,
            label_smoothing=recipe.dpo_label_smoothing,
            simpo_gamma=recipe.resolved_simpo_gamma,
            cpo_alpha=recipe.resolved_cpo_alpha,
        )

    @property
    def needs_reference(self) -> bool:
        """The loss reads the reference's sums (dpo, ipo)."""
        return self.kind in ("dpo", "ipo")

    @property
    def metric_names(self) -> tuple[str, ...]:
        """What :meth:`PairOutputs.metric_sums` holds for this loss."""
        return METRICS + EXTRA_METRICS[self.kind]

    def pair_outputs(
        self, policy: torch.Tensor, reference: torch.Tensor | None, targets: torch.Tensor
    ) -> PairOutputs:
        """Per-pair losses and metric inputs from complete per-sequence sums.

        Args:
            policy: ``(2·pairs,)`` log-prob sums of every sequence under the policy (sequence
                ``2k`` the chosen side of pair ``k``, ``2k + 1`` its rejected side).
            reference: The same under the reference; None for a loss that reads none (orpo, simpo).
            targets: The target count of every sequence (the per-token means of ipo, orpo and simpo).
        """
        if not self.needs_reference:
            return self._reference_free(policy / targets.to(policy.dtype).clamp(min=1.0))
        if reference is None:
            raise ValueError(f"rl: {self.kind} needs the reference's sums")
        chosen_ratio = policy[0::2] - reference[0::2]
        rejected_ratio = policy[1::2] - reference[1::2]
        if self.kind == "ipo":
            counts = targets.to(policy.dtype).clamp(min=1.0)
            difference = chosen_ratio / counts[0::2] - rejected_ratio / counts[1::2]
            losses = (difference - 1 / (2 * self.beta)) ** 2
        elif self.kind == "dpo":
            scaled = self.beta * (chosen_ratio - rejected_ratio)
            losses = -F.logsigmoid(scaled)
            if self.label_smoothing:
                losses = (1 - self.label_smoothing) * losses - self.label_smoothing * F.logsigmoid(-scaled)
        else:
            raise ValueError(f"unknown preference loss {self.kind!r}")
        return PairOutputs(
            losses=losses,
            chosen_logps=policy[0::2].detach(),
            rejected_logps=policy[1::2].detach(),
            chosen_rewards=self.beta * chosen_ratio.detach(),
            rejected_rewards=self.beta * rejected_ratio.detach(),
        )

    def _reference_free(self, means: torch.Tensor) -> PairOutputs:
        """orpo and simpo from each sequence's per-token mean log-prob ``means`` (``(2·pairs,)``)."""
        chosen, rejected = means[0::2], means[1::2]
        nll = -chosen
        extras: dict[str, torch.Tensor] = {"nll_loss": nll.detach()}
        if self.kind == "simpo":
            losses = -F.logsigmoid(self.beta * (chosen - rejected) - self.simpo_gamma)
            if self.cpo_alpha:
                losses = losses + self.cpo_alpha * nll
        elif self.kind == "orpo":
            log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
            ratio = F.logsigmoid(log_odds)
            losses = nll - self.beta * ratio
            extras |= {"log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}
        else:
            raise ValueError(f"unknown preference loss {self.kind!r}")
        return PairOutputs(
            losses=losses,
            chosen_logps=chosen.detach(),
            rejected_logps=rejected.detach(),
            chosen_rewards=self.beta * chosen.detach(),
            rejected_rewards=self.beta * rejected.detach(),
            extras=extras,
        )


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − eˣ)`` for ``x < 0``, accurate on both sides of ``−log 2`` (Mächler, "Accurately computing
    log(1 − exp(−|a|))", 2012): ``log(−expm1(x))`` near 0, ``log1p(−eˣ)`` below."""
    near_zero = x > -math.log(2)
    return torch.where(near_zero, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@dataclass(frozen=True)
class PairBatch:
    """One micro batch of preference rows, whole (every rank of a CP group holds the same).

    Attributes:
        tokens: The rows' tokens, positions and targets.
        sequence_ids: ``(rows, tokens)``: ``2·pair + side`` of each token, -1 on padding.
        pairs: Pairs in the batch.
        reference_logps: ``(2·pairs,)`` the reference's complete log-prob sums, when precomputed
            (``precompute_ref_log_probs``); None: the reference runs with the policy.
    """

    tokens: TokenBatch
    sequence_ids: torch.Tensor
    pairs: int
    reference_logps: torch.Tensor | None = None

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any]) -> PairBatch:
        """From the collator's batch (:class:`~cptune.data.collator.PackedCollator` with ``preference``)."""
        return cls(
            tokens=TokenBatch(
                input_ids=inputs["input_ids"],
                position_ids=inputs["position_ids"],
                shift_labels=inputs["shift_labels"],
            ),
            sequence_ids=inputs["sequence_ids"],
            pairs=int(inputs["pairs"]),
            reference_logps=inputs.get("reference_logps"),
        )

    @property
    def sequences(self) -> int:
        return 2 * self.pairs

    def target_counts(self) -> torch.Tensor:
        """Targets of every sequence of the batch, counted on the whole rows (no collective needed)."""
        kept = self.tokens.shift_labels != IGNORE_INDEX
        ids = self.sequence_ids.to(kept.device)[kept]
        return torch.zeros(self.sequences, dtype=torch.int64, device=kept.device).index_add(
            0, ids, torch.ones_like(ids)
        )

    def shard_segments(self, coords: TokenCoords | None, shift_labels: torch.Tensor) -> Segments:
        """The sequence of each of a rank's tokens, from where its shard's tokens sit in the whole batch.

        Raises:
            CptuneError: The backend gives no token coordinates.
            RuntimeError: A target of the shard belongs to no sequence (a bug in the layout).
        """
        if coords is None:
            raise CptuneError("this cp_backend gives no token coordinates, which preference training needs")
        sequence_ids = self.sequence_ids.to(coords.rows.device)
        real = coords.rows >= 0
        # Padding a backend adds to split rows evenly has row -1 and columns past the rows' end.
        rows, columns = coords.rows.clamp(min=0), coords.columns.clamp(max=sequence_ids.shape[-1] - 1)
        ids = torch.where(real, sequence_ids[rows, columns], -1)
        if bool((ids[shift_labels.to(ids.device) != IGNORE_INDEX] < 0).any()):
            raise RuntimeError("a target of this rank's shard belongs to no preference sequence")
        return ids, self.sequences


def sequence_log_probs(
    model: torch.nn.Module, sharded: ShardedInputs, shard_loss: Callable[..., Any], batch: PairBatch
) -> torch.Tensor:
    """This rank's part of every sequence's log-prob sum: ``(2·pairs,)``, from its shard's targets only."""
    return _shard_sums_and_counts(model, sharded, shard_loss, batch)[0]


def _shard_sums_and_counts(
    model: torch.nn.Module, sharded: ShardedInputs, shard_loss: Callable[..., Any], batch: PairBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of every sequence's log-prob sum and of its target count (both ``(2·pairs,)``)."""
    segments = batch.shard_segments(sharded.coords, sharded.shift_labels)
    loss_sums, _ = shard_loss(model, sharded.model_kwargs, sharded.shift_labels, segments=segments)
    ids, count = segments
    kept = sharded.shift_labels.reshape(-1).to(ids.device) != IGNORE_INDEX
    targets = torch.bincount(ids.reshape(-1)[kept], minlength=count).to(loss_sums)
    return -loss_sums, targets


def pair_forward(
    model: torch.nn.Module,
    reference_model: torch.nn.Module,
    sharder: BatchSharder,
    shard_loss: Callable[..., Any],
    batch: PairBatch,
    loss: PreferenceLoss,
    group: dist.ProcessGroup | None,
    *,
    reference_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    on_shard: Callable[[ShardedInputs], None] | None = None,
    attention_layers: int | None = None,
    complete: Callable[
        [torch.Tensor, dist.ProcessGroup | None], torch.Tensor
    ] = differentiable_all_reduce_sum,
) -> PairOutputs:
    """The reference and policy forwards of one micro batch on this rank, completed over its CP group.

    Args:
        model: The policy as trained (possibly wrapped by DDP).
        reference_model: The model the reference forward calls (the unwrapped one).
        sharder: The backend's sharder of this process.
        shard_loss: :func:`cptune.models.head_loss.logits_loss` or the chunked head loss.
        batch: The micro batch, whole.
        loss: The preference loss.
        group: This rank's CP group; None when the rank holds whole rows (cp=1): its sums are complete.
        reference_context: Entered around the reference forward (besides ``torch.no_grad``): turns the
            policy into the reference (the adapter disabled). No reference forward runs when the batch
            carries precomputed sums (``batch.reference_logps``) or the loss reads none (orpo, simpo).
        on_shard: Called with the policy forward's shard before it runs (exact dropout's keys).
        attention_layers: The model's attention layers, to check each forward went through the backend.
        complete: Completes the policy's sums, followed by the sequences' target counts, over the group
            (replaceable to plant a bug in tests).
    """
    reference = None
    if loss.needs_reference and batch.reference_logps is None:
        reference = reference_log_probs(
            reference_model, sharder, shard_loss, batch, group, reference_context, attention_layers
        )
    elif loss.needs_reference:
        reference = batch.reference_logps
    sharded = sharder.shard(batch.tokens)
    if on_shard is not None:
        on_shard(sharded)
    sums, targets = _shard_sums_and_counts(model, sharded, shard_loss, batch)
    _check_served(sharded, attention_layers)
    # The counts go with the sums through one collective: each mean divides the sum of the tokens it counted.
    local = torch.cat([sums, targets])
    policy, targets = (local if group is None else complete(local, group)).split(batch.sequences)
    return loss.pair_outputs(policy, None if reference is None else reference.to(policy), targets.detach())


def reference_log_probs(
    model: torch.nn.Module,
    sharder: BatchSharder,
    shard_loss: Callable[..., Any],
    batch: PairBatch,
    group: dist.ProcessGroup | None,
    reference_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    attention_layers: int | None = None,
) -> torch.Tensor:
    """The reference's complete log-prob sums of every sequence of ``batch``: ``(2·pairs,)``, no gradients.

    Each rank runs ``model`` (under ``reference_context``) on its shard; a plain all-reduce over ``group``
    completes the sums (None: whole rows, complete already). The first pass of
    ``precompute_ref_log_probs`` calls it as :func:`pair_forward` does.
    """
    shard = sharder.shard(batch.tokens)
    with torch.no_grad(), reference_context():
        local = sequence_log_probs(model, shard, shard_loss, batch)
    _check_served(shard, attention_layers)
    return local if group is None else all_reduce_sum(local, group)


def _check_served(sharded: ShardedInputs, attention_layers: int | None) -> None:
    if sharded.call is not None and attention_layers is not None:
        check_layers_served(sharded.call, attention_layers)


def preference_step_loss(
    outputs: PairOutputs, step_pairs: torch.Tensor, cp_size: int, gradient_divisor: int
) -> torch.Tensor:
    """What this rank backpropagates for one micro batch: its ``1/cp_size`` share of the batch's pair losses,
    scaled so that the optimizer step's gradient is that of the mean over the step's ``step_pairs`` pairs.

    The ``cp_size`` ranks of a group compute the same losses; the backward of the completing all-reduce
    adds their shares, and DDP (or FSDP2) divides the gradients summed over ``gradient_divisor`` ranks
    by that number, as for the SFT loss (:func:`cptune.parallel.loss.scaled_step_loss`). The Trainer's
    logged loss (the mean over processes of these values) is the step's mean pair loss.
    """
    return scaled_step_loss(outputs.losses.sum() / cp_size, step_pairs, gradient_divisor)
