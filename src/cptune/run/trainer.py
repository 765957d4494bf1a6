"""cptune's Trainer: the Hugging Face Trainer with exact sharding and token-weighted loss.

Uses the Trainer's documented extension points (``compute_loss``,
``loss_is_scaled_for_ga``) rather than patches: every micro batch is sharded by the
context-parallel backend, the loss is computed from this rank's logits and its
pre-shifted targets, and scaled so that the optimizer step's gradient is that of
the global token mean (see :mod:`cptune.parallel.loss`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer

from cptune.parallel.backends.attention import check_layers_served, count_attention_layers
from cptune.parallel.backends.base import CpBackend, step_context
from cptune.parallel.loss import count_targets, scaled_step_loss, step_target_count, token_loss_sum
from cptune.parallel.shard import TokenBatch

# Builds the backend once the accelerator (and so the process groups) exists.
BackendFactory = Callable[[Any], CpBackend]


class CptuneTrainer(Trainer):
    """A Trainer whose loss is the token-weighted mean over the whole optimizer step."""

    # compute_loss returns a loss already normalised by the step's target count.
    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, backend_factory: BackendFactory, cp_size: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cp_size = cp_size
        self.cp_backend = backend_factory(self.accelerator)
        self._attention_layers = count_attention_layers(self.accelerator.unwrap_model(self.model))
        self._throughput = Throughput()

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch=None):
        with step_context(self.cp_backend):
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any):
        with step_context(self.cp_backend):
            return super().prediction_step(model, inputs, *args, **kwargs)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        local = sum((count_targets(b["shift_labels"]) for b in batch_samples), torch.tensor(0))
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
        batch = TokenBatch(
            input_ids=inputs["input_ids"],
            position_ids=inputs["position_ids"],
            shift_labels=inputs["shift_labels"],
        )
        sharded = self.cp_backend.shard(batch)
        outputs = model(**sharded.model_kwargs, use_cache=False)
        if sharded.call is not None:
            check_layers_served(sharded.call, self._attention_layers)
        loss_sum = token_loss_sum(outputs.logits, sharded.shift_labels)
        if num_items_in_batch is None:
            num_items_in_batch = self._get_num_items_in_batch([inputs], loss_sum.device)
        loss = scaled_step_loss(loss_sum, num_items_in_batch, self.accelerator.num_processes)
        return (loss, outputs) if return_outputs else loss

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        started = time.perf_counter()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._throughput.pause(time.perf_counter() - started)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            # Every rank logs training steps together, so this collective is matched.
            tokens_per_second = self._throughput.rate(self.cp_size)
            if tokens_per_second is not None:
                logs["tokens_per_second"] = round(tokens_per_second, 1)
                logs["tokens_per_second_per_process"] = round(
                    tokens_per_second / self.accelerator.num_processes, 1
                )
        super().log(logs, start_time)


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

    def rate(self, cp_size: int) -> float | None:
        """Tokens per second since the last call; every rank of a CP group counted the same batches."""
        total = torch.tensor(self._tokens, dtype=torch.int64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        now = time.perf_counter()
        elapsed, self._since, self._tokens = now - self._since, now, 0
        if elapsed <= 0:
            return None
        return int(total) / cp_size / elapsed
