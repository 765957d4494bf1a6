"""cptune's Trainer: the Hugging Face Trainer with exact sharding and token-weighted loss.

Where the Trainer has a documented extension point it uses it (``compute_loss``,
``loss_is_scaled_for_ga``, ``training_step``, ``prediction_step``, callbacks). Where it has
none it overrides or calls private members (the step's target count, the checkpoint folder
and its writing, the evaluation loop's helpers): each is declared in
:data:`cptune.patches.transformers_patches.TRAINER_OVERRIDES` and checked like a patch
(transformers' version and the member's parameters) when the Trainer is built, and listed by
``cptune validate`` and on the patches page. Every micro batch is sharded by the
context-parallel backend, the loss is computed from this rank's logits and its
pre-shifted targets, and scaled so that the optimizer step's gradient is that of
the global token mean (see :mod:`cptune.parallel.loss`). Evaluation reports the
exact token mean over the whole evaluation set (:mod:`cptune.run.training.eval_loop`), and
checkpoints appear only once complete (:mod:`cptune.run.training.checkpoints`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import EvalLoopOutput

from cptune.models.head_loss import ShardLoss, logits_loss
from cptune.parallel.backends.attention import (
    check_layers_served,
    count_attention_layers,
    count_windowed_layers,
)
from cptune.parallel.backends.base import BatchSharder
from cptune.parallel.collectives import all_reduce_sum
from cptune.parallel.dropout import use_exact_lora_dropout
from cptune.parallel.loss import count_targets, step_target_count
from cptune.parallel.router_loss import RouterBalance
from cptune.parallel.shard import TokenBatch, TokenCoords
from cptune.parallel.tensor_parallel import apply_tensor_parallel
from cptune.patches.overrides import check_overrides
from cptune.patches.transformers_patches import TRAINER_OVERRIDES
from cptune.run.training.adapter_save import zero3_adapter_state_dict
from cptune.run.training.checkpoints import save_checkpoint_atomically
from cptune.run.training.eval_loop import all_reduce_totals, build_eval_dataloader, evaluate_batches
from cptune.run.training.fsdp import gathered_state_dict
from cptune.run.training.micro_loss import training_loss

# Builds the backend once the accelerator (and so the process groups) exists: (accelerator, model).
BackendFactory = Callable[[Any, Any], BatchSharder]


class CptuneTrainer(Trainer):
    """A Trainer whose loss is the token-weighted mean over the whole optimizer step."""

    # compute_loss returns a loss already normalised by the step's target count.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *args: Any,
        backend_factory: BackendFactory,
        cp_size: int,
        shard_loss: ShardLoss = logits_loss,
        tp_size: int = 1,
        **kwargs: Any,
    ):
        check_overrides(TRAINER_OVERRIDES).raise_for_problems()
        config = getattr(kwargs.get("model"), "config", None)
        use_cache = getattr(config, "use_cache", None)
        super().__init__(*args, **kwargs)
        if use_cache is not None:
            # The Trainer sets the model's use_cache to TrainingArguments.use_cache (False; transformers
            # 5.23 trainer.py:646), and the config is saved with the model and its checkpoints: a
            # saved full fine-tune would generate without a KV cache. cptune passes use_cache=False on
            # each call instead (the shard loss), so the config keeps the model's own value.
            self.model.config.use_cache = use_cache
        self._shard_loss = shard_loss
        self.cp_size = cp_size
        # Ranks that see the same batches: a CP group, times the tensor-parallel ranks of each of its ranks.
        self.batch_group_size = cp_size * tp_size
        if tp_size > 1:
            # On the tp axis of accelerate's own mesh, which FSDP2 shards over (cptune.parallel.tensor_parallel).
            apply_tensor_parallel(self.model, self.accelerator.torch_device_mesh["tp"])
        self.cp_backend = backend_factory(self.accelerator, self.model)
        # None at cp=1: each rank holds whole rows, its sums are complete.
        self._cp_group = self.accelerator.torch_device_mesh["cp"].get_group() if cp_size > 1 else None
        self._tp_group = self.accelerator.torch_device_mesh["tp"].get_group() if tp_size > 1 else None
        # A mixture-of-experts model's router loss, which its own forward adds to the loss cptune replaces.
        self._router = RouterBalance.from_config(self.accelerator.unwrap_model(self.model).config)
        self._router_log = RouterLossLog()
        self.data_collator = self.cp_backend.wrap_collator(self.data_collator)
        unwrapped = self.accelerator.unwrap_model(self.model)
        self._attention_layers = count_attention_layers(unwrapped)
        # Each must pass its window to a CP attention that computes it (attention.check_layers_served).
        self._windowed_layers = count_windowed_layers(unwrapped.config.get_text_config())
        self._throughput = Throughput()
        self.add_callback(LogLastStep())
        # LoRA dropout whose masks follow the tokens, so a CP run draws what its cp=1 run draws.
        self._dropout_keys = use_exact_lora_dropout(self.model, self.args.seed)
        self._micro = MicroBatchCounter()
        # Set while a checkpoint is written: the Trainer then writes into cptune's staging folder.
        self._checkpoint_staging: Path | None = None

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch=None):
        self._micro.next(self.state.global_step, self.args.gradient_accumulation_steps)
        with self.cp_backend.step_context():
            # The Trainer logs the mean over processes of these values: the step's token mean
            # (cptune.parallel.loss).
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any):
        with self.cp_backend.step_context():
            return super().prediction_step(model, inputs, *args, **kwargs)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        local = sum((count_targets(b["shift_labels"]) for b in batch_samples), torch.tensor(0))
        # Every rank of a CP group counts the group's whole batch. The tensor-parallel ranks count it
        # once more each: the count comes out tp times the step's, as does the world size the loss is
        # scaled by while FSDP2 averages over world / tp ranks, so the two cancel and the logged loss
        # (a mean over every rank) is the step's token mean.
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
        loss_sum, sharded, outputs = self._shard_forward(model, inputs)
        if num_items_in_batch is None:
            num_items_in_batch = self._get_num_items_in_batch([inputs], loss_sum.device)
        # DDP, FSDP2 and DeepSpeed (given no sequence-parallel group) average the gradients over every rank.
        # Evaluation reports the token loss alone (eval_loop), so the router loss is a training term only.
        loss, router_aux = training_loss(
            loss_sum,
            outputs,
            sharded.coords,
            step_targets=num_items_in_batch,
            gradient_divisor=self.accelerator.num_processes,
            router=self._router if model.training else None,
            accumulation=self.current_gradient_accumulation_steps if model.training else 1,
            cp_group=self._cp_group,
        )
        if router_aux is not None:
            self._router_log.add(router_aux)
        return (loss, outputs) if return_outputs else loss

    def _shard_forward(self, model: torch.nn.Module, inputs: dict[str, Any]):
        """This rank's shard of the batch through the model: (token loss sum, the shard's inputs, outputs)."""
        batch = TokenBatch(
            input_ids=inputs["input_ids"],
            position_ids=inputs["position_ids"],
            shift_labels=inputs["shift_labels"],
        )
        sharded = self.cp_backend.shard(batch)
        if model.training and self._dropout_keys is not None:
            self._key_dropout(sharded.coords)
        # The shard loss calls the model with use_cache=False: transformers keeps packed documents apart
        # from position_ids only without a KV cache (5.23 masking_utils), and training needs none.
        loss_sum, outputs = self._shard_loss(model, sharded.model_kwargs, sharded.shift_labels)
        if sharded.call is not None:
            check_layers_served(sharded.call, self._attention_layers, self._windowed_layers)
        return loss_sum, sharded, outputs

    def _key_dropout(self, coords: TokenCoords | None) -> None:
        """Tell the exact dropout where this micro batch's tokens sit in the training data."""
        if coords is None:
            raise RuntimeError(
                f"{type(self.cp_backend).__name__} gives no token coordinates for exact dropout"
            )
        dp_size = self.accelerator.num_processes // self.batch_group_size
        dp_rank = self.accelerator.process_index // self.batch_group_size
        number = self.cp_backend.batch_number(self._micro.index, dp_rank, dp_size)
        self._dropout_keys.set_coords(coords, first_row=number * self.args.per_device_train_batch_size)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's save; for a sharded (FSDP2) model, the gathered weights in a standard folder.

        With sharded state dicts the Trainer writes no weights here (checkpoints
        hold them sharded, written with the optimizer state); the final model is
        gathered instead, the adapter only for LoRA. A LoRA adapter under ZeRO-3 (final
        and in checkpoints) holds what peft saves without ZeRO (:mod:`cptune.run.training.adapter_save`).
        """
        from peft import PeftModel

        is_adapter = isinstance(self.model, PeftModel)
        if self.is_deepspeed_enabled and is_adapter and self.deepspeed.zero_optimization_partition_weights():
            state = zero3_adapter_state_dict(self.deepspeed, self.model)
            self._save(output_dir or self.args.output_dir, state_dict=state)
            return None
        if not (self.is_fsdp_enabled and not _internal_call):
            return super().save_model(output_dir, _internal_call)
        state_dict = gathered_state_dict(self.model, trainable_only=is_adapter)
        self._save(output_dir or self.args.output_dir, state_dict=state_dict)
        return None

    def get_eval_dataloader(self, eval_dataset: Any = None):
        """This data-parallel group's evaluation rows, each once (see :mod:`cptune.run.training.eval_loop`)."""
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        # The ranks of a CP (x TP) group evaluate the same rows, each its shard of them.
        return build_eval_dataloader(
            dataset,
            batch_size=self.args.eval_batch_size,
            collate_fn=self.data_collator,
            dp_size=self.accelerator.num_processes // self.batch_group_size,
            dp_rank=self.accelerator.process_index // self.batch_group_size,
            num_workers=self.args.dataloader_num_workers,
        )

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        """Token-weighted loss over the whole evaluation set: sums per process, one all-reduce at the end."""
        # Under no_grad the model needs no DDP wrapper (the Trainer's own loop does the same).
        model = self._wrap_model(self.model, training=False)
        model.eval()
        self.callback_handler.eval_dataloader = dataloader

        def local_loss(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
            inputs = self._prepare_inputs(inputs)
            with self.cp_backend.step_context(), self.compute_loss_context_manager():
                loss_sum, sharded, _ = self._shard_forward(model, inputs)
            return loss_sum, count_targets(sharded.shift_labels)

        def progress() -> None:
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)

        loss_sum, targets = evaluate_batches(dataloader, local_loss, progress)
        totals = all_reduce_totals(loss_sum, targets)
        return EvalLoopOutput(
            predictions=None,
            label_ids=None,
            metrics=totals.metrics(metric_key_prefix),
            num_samples=len(dataloader.dataset.source),  # the evaluation rows, without fillers
        )

    def _get_output_dir(self, trial: Any) -> str:
        if self._checkpoint_staging is not None:
            return str(self._checkpoint_staging)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint, written into a staging folder and published when complete."""

        def write(staging_root: Path) -> None:
            self._checkpoint_staging = staging_root
            try:
                super(CptuneTrainer, self)._save_checkpoint(model, trial)
            finally:
                self._checkpoint_staging = None

        started = time.perf_counter()
        save_checkpoint_atomically(
            output_dir=self._get_output_dir(trial),
            step=self.state.global_step,
            is_writer=self.args.should_save,
            barrier=self.accelerator.wait_for_everyone,
            write=write,
            save_total_limit=self.args.save_total_limit,
        )
        # Writing a checkpoint is not training: keep it out of tokens_per_second.
        self._throughput.pause(time.perf_counter() - started)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        started = time.perf_counter()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._throughput.pause(time.perf_counter() - started)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            # Every rank logs training steps together, so this collective is matched.
            tokens_per_second = self._throughput.rate(self.batch_group_size)
            if tokens_per_second is not None:
                logs["tokens_per_second"] = round(tokens_per_second, 1)
                logs["tokens_per_second_per_process"] = round(
                    tokens_per_second / self.accelerator.num_processes, 1
                )
            if self._router is not None:
                logs.update(self._router_log.mean())
        super().log(logs, start_time)


class LogLastStep(TrainerCallback):
    """Log the last optimizer step, so the run's ``train_loss`` is averaged over every rank.

    The Trainer averages each logged loss over the processes, but at the end of
    training it adds the loss of the steps since the last log as this rank alone
    saw it (transformers 5.23, ``Trainer._finalize_training``). Under CP a rank
    holds the loss of its own shard only, so ``train_loss`` came out different from
    the cp=1 run whenever ``max_steps`` was not a multiple of ``logging_steps``.
    Logging the last step leaves nothing unaveraged, as the Trainer already does
    for evaluation and saving at the end.
    """

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # Runs after the Trainer's DefaultFlowCallback, which decides that training stops here.
        if control.should_training_stop:
            control.should_log = True
        return control


class RouterLossLog:
    """The router loss of the micro batches this rank trained since the last log, for ``router_aux_loss``."""

    def __init__(self) -> None:
        self._sums = torch.zeros(2, dtype=torch.float64)

    def add(self, aux: torch.Tensor) -> None:
        self._sums += torch.tensor([float(aux), 1.0], dtype=torch.float64)

    def mean(self) -> dict[str, float]:
        """The mean router loss per micro batch over every rank since the last call (a collective), then reset.

        The ranks of a CP group hold the same value (the loss of their whole micro batch) and count in
        the sum and the count alike, so the mean is over the data-parallel groups' micro batches: what the
        cp=1 run with the same data parallelism logs.
        """
        totals = all_reduce_sum(self._sums)
        self._sums.zero_()
        if float(totals[1]) == 0:
            return {}
        return {"router_aux_loss": float(totals[0]) / float(totals[1])}


class MicroBatchCounter:
    """Which training micro batch of the run this rank is at: ``global_step · accumulation + k``.

    Counted from the optimizer step the Trainer is at, so a resumed run counts on from
    its checkpoint as the uninterrupted run did.
    """

    def __init__(self) -> None:
        self.index = -1
        self._step = -1
        self._in_step = 0

    def next(self, global_step: int, accumulation: int) -> int:
        """Advance to the next micro batch (call once per training micro batch) and return its index."""
        if global_step != self._step:
            self._step, self._in_step = global_step, 0
        self.index = global_step * accumulation + self._in_step
        self._in_step += 1
        return self.index


class Throughput:
    """Real (non-padding) tokens trained per second, over all data-parallel groups."""

    def __init__(self) -> None:
        self._tokens = 0
        self._since = time.perf_counter()

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (e.g. an evaluation) out of the current interval."""
        self._since += seconds

    def rate(self, batch_group_size: int) -> float | None:
        """Tokens per second since the last call; every rank of a CP (× TP) group counted the same batches."""
        # On the process group's device: NCCL refuses the CPU tensor this count starts as.
        total = all_reduce_sum(torch.tensor(self._tokens, dtype=torch.int64))
        now = time.perf_counter()
        elapsed, self._since, self._tokens = now - self._since, now, 0
        if elapsed <= 0:
            return None
        return int(total) / batch_group_size / elapsed
