"""cptune's Trainer: the Hugging Face Trainer with exact sharding and token-weighted loss.

Uses the Trainer's documented extension points (``compute_loss``,
``loss_is_scaled_for_ga``) rather than patches: every micro batch is sharded by the
context-parallel backend, the loss is computed from this rank's logits and its
pre-shifted targets, and scaled so that the optimizer step's gradient is that of
the global token mean (see :mod:`cptune.parallel.loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

from cptune.parallel.backends.attention import check_layers_served, count_attention_layers
from cptune.parallel.backends.base import CpBackend
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
