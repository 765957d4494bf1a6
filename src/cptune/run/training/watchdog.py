"""The loss watchdog: stop training when the logged loss stays above a threshold.

Apart from cptune.run.training.tracking so that checking a recipe's trackers (preflight, in the launcher
process) does not import transformers' Trainer modules.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

log = logging.getLogger("cptune.train")


class LossWatchdog(TrainerCallback):
    """Stop training when the logged loss stays above a threshold (Axolotl's ``loss_watchdog_*``).

    Every rank sees the same logged loss (the Trainer averages it over processes), so every rank
    stops at the same step; the run then ends as a finished run does, saving the model.
    """

    def __init__(self, threshold: float, patience: int):
        self.threshold = threshold
        self.patience = patience
        self.violations = 0

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any
    ):
        loss = (logs or {}).get("loss")
        if loss is None:
            return control
        self.violations = self.violations + 1 if loss > self.threshold else 0
        if self.violations >= self.patience:
            if state.is_world_process_zero:
                log.warning(
                    "loss_watchdog: the loss was above %s for %d logs in a row (last %.4f); stopping at step %d",
                    self.threshold,
                    self.violations,
                    loss,
                    state.global_step,
                )
            control.should_training_stop = True
        return control
