"""Preference losses (DPO, IPO) under context parallelism, exact at every CP size.

The design (``docs/preference-training.md``, "How it works"): a pair is one row of two documents
(prompt + chosen, prompt + rejected) and the collator numbers the sequences of a batch
(:func:`cptune.labels.pair_sequence_ids`). Each rank sums the log-probabilities of the targets of
its own shard per sequence, with the same fp32 machinery as the SFT loss
(:func:`cptune.parallel.loss.token_loss_sum` and its chunked head variant, given ``segments``); a sum
all-reduce over the CP group completes the sums (:func:`~cptune.parallel.collectives.differentiable_all_reduce_sum`:
its backward adds the gradients of the group's ranks). The reference is the same model with its
adapter disabled, run on the same shard without gradients. Every rank then computes the same
per-pair losses and backpropagates ``1/C`` of their sum, scaled as the SFT loss is
(:func:`preference_step_loss`), which gives the gradient of the mean over every pair of the
optimizer step.

Pure arithmetic (:class:`PreferenceLoss`, :class:`PairBatch`) apart from the one function that
runs the model and talks to the process group (:func:`pair_forward`).
"""

from __future__ import annotations

import contextlib
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


@dataclass(frozen=True)
class PairOutputs:
    """Per-pair results of one batch: the losses (with their graph) and, detached, what the metrics read."""

    losses: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    def metric_sums(self) -> dict[str, torch.Tensor]:
        """Each of :data:`METRICS` summed over the batch's pairs (divide by the pairs for the mean)."""
        chosen, rejected = self.chosen_rewards, self.rejected_rewards
        values = (
            chosen,
            rejected,
            (chosen > rejected).to(chosen.dtype),
            chosen - rejected,
            self.chosen_logps,
            self.rejected_logps,
        )
        return {name: value.sum() for name, value in zip(METRICS, values, strict=True)}


@dataclass(frozen=True)
class PreferenceLoss:
    """The per-pair loss of ``rl`` (``dpo`` or ``ipo``) with its β and label smoothing.

    With ``s = β·((π_c − ref_c) − (π_r − ref_r))`` over the sequences' log-prob sums: ``dpo`` is
    ``−(1 − ε)·log σ(s) − ε·log σ(−s)`` (TRL's ``sigmoid`` loss at ``ε = 0``); ``ipo`` is
    ``(x − 1/(2β))²`` with ``x`` the same log-ratio difference of per-token means (each side's sums
    divided by its target count), as TRL's ``ipo``. The rewards are ``β·(π − ref)`` of each side.
    """

    kind: str
    beta: float
    label_smoothing: float = 0.0

    @classmethod
    def from_recipe(cls, recipe: Any) -> PreferenceLoss:
        """The loss a validated recipe with ``rl`` asks for."""
        return cls(kind=recipe.rl, beta=recipe.resolved_beta, label_smoothing=recipe.dpo_label_smoothing)

    def pair_outputs(
        self, policy: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor
    ) -> PairOutputs:
        """Per-pair losses and metric inputs from complete per-sequence sums.

        Args:
            policy: ``(2·pairs,)`` log-prob sums of every sequence under the policy (sequence
                ``2k`` the chosen side of pair ``k``, ``2k + 1`` its rejected side).
            reference: The same under the reference.
            targets: The target count of every sequence (IPO's per-token means).
        """
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
    segments = batch.shard_segments(sharded.coords, sharded.shift_labels)
    loss_sums, _ = shard_loss(model, sharded.model_kwargs, sharded.shift_labels, segments=segments)
    return -loss_sums


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
            carries precomputed sums (``batch.reference_logps``).
        on_shard: Called with the policy forward's shard before it runs (exact dropout's keys).
        attention_layers: The model's attention layers, to check each forward went through the backend.
        complete: Completes the policy's sums over the group (replaceable to plant a bug in tests).
    """
    if batch.reference_logps is None:
        reference = reference_log_probs(
            reference_model, sharder, shard_loss, batch, group, reference_context, attention_layers
        )
    else:
        reference = batch.reference_logps
    sharded = sharder.shard(batch.tokens)
    if on_shard is not None:
        on_shard(sharded)
    local = sequence_log_probs(model, sharded, shard_loss, batch)
    _check_served(sharded, attention_layers)
    policy = local if group is None else complete(local, group)
    return loss.pair_outputs(policy, reference.to(policy), batch.target_counts())


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
