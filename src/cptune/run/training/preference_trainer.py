"""cptune's Trainer for preference training (``rl: dpo``, ``ipo``, ``orpo``, ``simpo``): one loss per pair,
exact under CP.

Each micro batch goes through :func:`cptune.parallel.preference.pair_forward` (the reference with the
adapter disabled (dpo, ipo), then the policy, each on this rank's shard, completed over the CP group) and this
rank backpropagates its share of the pair losses scaled to the mean over the optimizer step's pairs
(:func:`~cptune.parallel.preference.preference_step_loss`). The step's pairs are counted as the SFT
loss counts its targets. The metrics TRL logs (:data:`~cptune.parallel.preference.METRICS` and the
loss's extras, e.g. ORPO's ``log_odds_ratio``) are summed per pair and logged as means over the pairs since
the last log. Evaluation reports the same loss and metrics over the evaluation pairs, prefixed ``eval_``
(:meth:`PreferenceTrainer.evaluation_loop`). With ``precompute_ref_log_probs`` the reference's sums of the
training and evaluation rows come from a first pass (:mod:`cptune.run.training.reference_pass`): when the
trainer is built, or, with the parameters sharded (FSDP2, ZeRO-3), once the Trainer has prepared the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from transformers.trainer_utils import EvalLoopOutput

from cptune.errors import CptuneError
from cptune.models.reference import adapter_disabled
from cptune.parallel.collectives import all_reduce_sum, is_distributed
from cptune.parallel.loss import step_target_count
from cptune.parallel.preference import (
    METRICS,
    PairBatch,
    PairOutputs,
    PreferenceLoss,
    pair_forward,
    preference_step_loss,
)
from cptune.run.training.reference_cache import ReferenceStore
from cptune.run.training.reference_pass import (
    COLUMN,
    RowsAwaitingReference,
    precompute_reference,
    row_pair_counts,
    with_reference_column,
)
from cptune.run.training.trainer import CptuneTrainer

log = logging.getLogger("cptune.preference")


class PreferenceTrainer(CptuneTrainer):
    """A :class:`CptuneTrainer` whose loss is the mean preference loss over the optimizer step's pairs."""

    def __init__(
        self,
        *args: Any,
        preference_loss: PreferenceLoss,
        precompute_reference: bool = False,
        reference_store: ReferenceStore | None = None,
        training: bool = True,
        model_is_reference: bool = True,
        **kwargs: Any,
    ):
        """Args (besides the Trainer's):
        preference_loss: The loss of ``rl``.
        precompute_reference: ``precompute_ref_log_probs``: the reference sums come from a first pass.
        reference_store: Where the first pass's sums are stored and read back (None: computed each run).
        training: False under ``cptune evaluate``: the first pass runs over the evaluation rows only.
        model_is_reference: False where the model is a saved full fine-tune (``cptune evaluate``): its
            reference, the base model, is not loaded, and the evaluation rows' sums must be read from
            ``reference_store``.
        """
        super().__init__(*args, **kwargs)
        if self._router is not None:
            raise CptuneError(
                "rl: the model adds a router load-balancing loss (output_router_logits with router_aux_loss_coef "
                f"{self._router.coef}), which cptune's preference loss does not include yet. Set "
                "output_router_logits: false in overrides_of_model_config to train without it."
            )
        self.preference_loss = preference_loss
        unwrapped = self.accelerator.unwrap_model(self.model)
        has_adapter = callable(getattr(unwrapped, "disable_adapter", None))
        # A full fine-tune's reference is the model as loaded, which only the first pass below sees.
        # orpo and simpo run no reference forward, so a full fine-tune of theirs needs no context either.
        by_adapter = has_adapter or (preference_loss.needs_reference and not precompute_reference)
        self._reference_context = adapter_disabled(unwrapped) if by_adapter else contextlib.nullcontext
        self._metrics = PairMetrics(preference_loss.metric_names)
        # With sharded parameters the first pass needs the prepared model: it runs in _prepare_for_training.
        self._reference_store = reference_store
        self._rows_awaiting_reference: RowsAwaitingReference | None = None
        if not precompute_reference:
            return
        sharded = self._parameters_sharded()
        if training and sharded:
            # With sharded parameters the first pass needs the prepared model: it runs in _prepare_for_training.
            self._rows_awaiting_reference = RowsAwaitingReference(self.train_dataset)
            self.train_dataset = self._rows_awaiting_reference
            return
        # An evaluation prepares a sharded model only inside evaluate(): its first pass is not built, and a LoRA
        # adapter's evaluation then runs the reference (the adapter disabled) with each batch.
        computes = model_is_reference and not sharded
        if computes:
            # The Trainer leaves a model DeepSpeed will train where it was loaded (its engine moves it at
            # train()); the first pass runs where training will.
            unwrapped.to(self.args.device)
        if training:
            sums = self._reference_sums(unwrapped, "train", self.train_dataset)
            self.train_dataset = with_reference_column(self.train_dataset, sums)
        self._precompute_evaluation_reference(unwrapped, computes=computes)
        if (
            not model_is_reference
            and self.eval_dataset is not None
            and COLUMN not in self.eval_dataset.column_names
        ):
            where = reference_store.path("eval") if reference_store is not None else "no store"
            raise CptuneError(
                "evaluate: the model is a full fine-tune, evaluated against its reference, the base model, whose "
                "log-prob sums of the evaluation pairs are read from those a run of this recipe stored "
                f"(precompute_ref_log_probs): none matches this recipe's data and base model ({where}). Run "
                "`cptune train` of this recipe with val_set_size (or test_datasets): its first pass stores them "
                "before training (max_steps: 1 is enough), or evaluate during that run (eval_steps)."
            )

    def _parameters_sharded(self) -> bool:
        """FSDP2 or ZeRO-3 holds each parameter split over the ranks (whole only inside a forward)."""
        if self.is_fsdp_enabled:
            return True
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        return plugin is not None and plugin.zero_stage == 3

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any):
        """The Trainer's preparation; with sharded parameters, the first pass between it and the checkpoint's load.

        The sharded model can run a forward only once prepared (every rank gathering each layer's
        parameters), and the reference is the model as loaded, not a checkpoint's weights: the Trainer
        prepares without the checkpoint, the first pass runs, then the checkpoint's states are loaded as the
        Trainer loads them (transformers 5.23 trainer.py:1800-1810).
        """
        rows = self._rows_awaiting_reference
        if rows is None:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        rows.fill(
            self._reference_sums(self.accelerator.unwrap_model(model), "train", rows.rows, sharded=True)
        )
        self._precompute_evaluation_reference(self.accelerator.unwrap_model(model), sharded=True)
        if resume_from_checkpoint is not None:
            self._load_sharded_checkpoint(resume_from_checkpoint)
        return model, train_dataloader

    def _load_sharded_checkpoint(self, checkpoint: str) -> None:
        """A checkpoint's model, optimizer, scheduler and scaler states, as the Trainer's preparation loads them."""
        from transformers.integrations.deepspeed import deepspeed_load_checkpoint
        from transformers.trainer_utils import _is_peft_model

        if self.is_deepspeed_enabled:
            strict = not _is_peft_model(self.model)
            deepspeed_load_checkpoint(self.model_wrapped, checkpoint, load_module_strict=strict)
        else:
            self._load_from_checkpoint(checkpoint, self.model_wrapped)
        self._load_optimizer_and_scheduler(checkpoint)
        self._load_scaler(checkpoint)

    def _reference_sums(
        self,
        model: torch.nn.Module,
        split: str,
        rows: Any,
        rows_per_batch: int | None = None,
        *,
        sharded: bool = False,
        computes: bool = True,
    ) -> list[list[float]] | None:
        """The reference sums of ``split``'s ``rows``: read from the store where every rank finds them whole, else
        from the first pass (then stored by each node's first process); None where the store has none and
        ``computes`` is False.

        The pass is a collective, so the ranks agree first (one all-reduce): one rank without a usable file
        (a node without the shared file system, a damaged copy) makes them all compute.
        """
        store = self._reference_store
        rows_name = {"train": "training", "eval": "evaluation"}[split]
        if store is not None:
            loaded = store.load(split, row_pair_counts(rows))
            found = torch.tensor([0 if loaded is None else 1], dtype=torch.int64, device=self.args.device)
            if int(all_reduce_sum(found).item()) == (dist.get_world_size() if is_distributed() else 1):
                log.info(
                    "precompute_ref_log_probs: the reference sums of %d %s rows read from %s (no first pass)",
                    len(rows),
                    rows_name,
                    store.path(split),
                )
                return loaded
        if not computes:
            return None
        where = " on the sharded model" if sharded else ""
        log.info(
            "precompute_ref_log_probs: the first pass over %d %s rows runs%s", len(rows), rows_name, where
        )
        started = time.perf_counter()
        sums = self._precompute_reference(model, rows, rows_per_batch)
        seconds = time.perf_counter() - started
        if store is not None and self.accelerator.is_local_main_process:
            path = store.save(split, sums)
            log.info(
                "precompute_ref_log_probs: the first pass took %.2f s; reference sums stored in %s",
                seconds,
                path,
            )
        return sums

    def _precompute_reference(
        self, model: torch.nn.Module, rows: Any, rows_per_batch: int | None = None
    ) -> list[list[float]]:
        """``precompute_ref_log_probs``: the reference sums of ``rows`` (training rows unless ``rows_per_batch``
        says otherwise), from ``model`` as loaded."""
        dp_size = self.accelerator.num_processes // self.batch_group_size
        return precompute_reference(
            rows,
            self.data_collator,
            model,
            self.cp_backend,
            self._shard_loss,
            rows_per_batch=rows_per_batch or self.args.per_device_train_batch_size,
            dp_rank=self.accelerator.process_index // self.batch_group_size,
            dp_size=dp_size,
            cp_group=self._cp_group,
            tp_group=self._tp_group,
            reference_context=self._reference_context,
            attention_layers=self._attention_layers,
            device=self.args.device,
        )

    def _precompute_evaluation_reference(
        self, model: torch.nn.Module, *, sharded: bool = False, computes: bool = True
    ) -> None:
        """The evaluation pairs' reference is the same model as loaded: their sums come from the first pass too
        (the evaluation's data loader is built when evaluation runs, after this)."""
        if self.eval_dataset is None:
            return
        batch = self.args.per_device_eval_batch_size
        sums = self._reference_sums(
            model, "eval", self.eval_dataset, batch, sharded=sharded, computes=computes
        )
        if sums is not None:
            self.eval_dataset = with_reference_column(self.eval_dataset, sums)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        local = torch.tensor(sum(int(b["pairs"]) for b in batch_samples), dtype=torch.int64)
        # Every rank of a CP group counts its group's pairs: the sum over the world counts each cp_size times.
        return step_target_count(local.to(device), self.cp_size)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ):
        if model.training and "num_tokens" in inputs:
            self._throughput.add(int(inputs["num_tokens"]))

        def key_dropout(sharded: Any) -> None:
            if model.training and self._dropout_keys is not None:
                self._key_dropout(sharded.coords)

        outputs = self._pair_forward(model, inputs, on_shard=key_dropout)
        if model.training:
            self._metrics.add(outputs.metric_sums(), len(outputs.losses))
        if num_items_in_batch is None:
            num_items_in_batch = self._get_num_items_in_batch([inputs], outputs.losses.device)
        loss = preference_step_loss(outputs, num_items_in_batch, self.cp_size, self.accelerator.num_processes)
        return (loss, None) if return_outputs else loss

    def _pair_forward(
        self, model: torch.nn.Module, inputs: dict[str, Any], on_shard: Any = None
    ) -> PairOutputs:
        """The micro batch's reference and policy forwards on this rank, completed over its CP group."""
        return pair_forward(
            model,
            self.accelerator.unwrap_model(model),
            self.cp_backend,
            self._shard_loss,
            PairBatch.from_inputs(inputs),
            self.preference_loss,
            self._cp_group,
            reference_context=self._reference_context,
            on_shard=on_shard,
            attention_layers=self._attention_layers,
        )

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        """The preference loss and metrics over every evaluation pair: per-pair sums, one all-reduce at the end.

        ``{prefix}_loss`` is the mean pair loss over the pairs of every data-parallel group and batch (as
        the training loss is over a step's pairs), the metrics means over the same pairs, and
        ``{prefix}_pairs`` their number. Filler rows (:class:`~cptune.run.training.eval_loop.EvalRows`)
        hold pairs without targets, which count nowhere.
        """
        model = self._wrap_model(self.model, training=False)
        model.eval()
        self.callback_handler.eval_dataloader = dataloader
        totals = PairMetrics(("loss", *self.preference_loss.metric_names))
        with torch.no_grad():
            for inputs in dataloader:
                inputs = self._prepare_inputs(inputs)
                with self.cp_backend.step_context(), self.compute_loss_context_manager():
                    outputs = self._pair_forward(model, inputs)
                held_out = pairs_with_targets(outputs, PairBatch.from_inputs(inputs).target_counts())
                totals.add({"loss": held_out.losses.sum(), **held_out.metric_sums()}, len(held_out.losses))
                self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        means = totals.means()
        if not means:
            raise CptuneError(
                "evaluation: the evaluation data holds no preference pair, so there is no loss to report. "
                "Check test_datasets / val_set_size."
            )
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in means.items()}
        # Every rank of a CP group counted its group's pairs.
        metrics[f"{metric_key_prefix}_pairs"] = totals.last_pairs // self.batch_group_size
        return EvalLoopOutput(
            predictions=None,
            label_ids=None,
            metrics=metrics,
            num_samples=len(dataloader.dataset.source),  # the evaluation rows, without fillers
        )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            # Every rank logs training steps together, so this collective is matched.
            logs.update(self._metrics.means())
        super().log(logs, start_time)


def pairs_with_targets(outputs: PairOutputs, targets: torch.Tensor) -> PairOutputs:
    """``outputs`` of the pairs whose two sides have targets: the real pairs, without the evaluation's fillers.

    Preparing the data drops a pair with a side without response tokens, so every real pair has
    targets on both sides; a filler row (every label -100) has none.

    Args:
        targets: The target count of every sequence of the batch (:meth:`PairBatch.target_counts`).
    """
    real = (targets[0::2] > 0) & (targets[1::2] > 0)
    per_pair = {f.name: getattr(outputs, f.name) for f in dataclasses.fields(outputs) if f.name != "extras"}
    extras = {name: value[real] for name, value in outputs.extras.items()}
    return PairOutputs(**{name: value[real] for name, value in per_pair.items()}, extras=extras)


class PairMetrics:
    """Sums of per-pair values (the preference metrics) and the pairs they cover since the last call, on this rank."""

    def __init__(self, names: tuple[str, ...] = METRICS) -> None:
        self.names = names
        self._sums = torch.zeros(len(names) + 1, dtype=torch.float64)
        self.last_pairs = 0

    def add(self, sums: dict[str, torch.Tensor], pairs: int) -> None:
        values = [float(sums[name]) for name in self.names]
        self._sums += torch.tensor([*values, pairs], dtype=torch.float64)

    def means(self) -> dict[str, float]:
        """Each value's mean over the pairs of every rank since the last call (a collective), then reset.

        The ranks of a CP group hold the same pairs: they count in the sums and in the pair count
        alike, so the mean is over distinct pairs. :attr:`last_pairs` keeps the pair count of every rank
        summed (each pair counted once per rank of its CP group).
        """
        totals = all_reduce_sum(self._sums)
        self._sums.zero_()
        pairs = float(totals[-1])
        self.last_pairs = round(pairs)
        if pairs == 0:
            return {}
        return {name: float(totals[i]) / pairs for i, name in enumerate(self.names)}
