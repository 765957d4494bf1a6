"""Experiment trackers and the loss watchdog: the Trainer's own integrations, configured from the recipe.

Weights & Biases runs through transformers' ``WandbCallback``, which reads its settings from
environment variables (``WANDB_PROJECT``, ``WANDB_WATCH``, ``WANDB_LOG_MODEL``; ``wandb.init`` reads
``WANDB_ENTITY``, ``WANDB_MODE``, ``WANDB_RUN_ID``). :func:`tracker_environment` gives them from the
recipe; :func:`cptune.run.training.train.train` sets them for the run and restores the environment afterwards.
The run's files go under ``output_dir/wandb`` unless ``WANDB_DIR`` says otherwise, so
``wandb_mode: offline`` writes a run folder there with no network (``wandb sync`` uploads it later).
"""

from __future__ import annotations

# transformers' Trainer modules are not imported here: preflight (in the launcher process, which
# never trains) checks the trackers, and importing transformers.trainer_callback imports peft and,
# through it, bitsandbytes, which compiles functions with torch.compile at import. The loss
# watchdog callback lives in cptune.run.training.watchdog.
import importlib.util
from collections.abc import Mapping
from typing import Any

from cptune.config.recipe import Recipe
from cptune.errors import BackendUnavailableError

WANDB_INSTALL_HINT = "pip install 'cptune[wandb]'"


def check_trackers(recipe: Recipe) -> None:
    """Refuse W&B logging when the wandb package is missing (before launching)."""
    if "wandb" in recipe.resolved_report_to and importlib.util.find_spec("wandb") is None:
        key = "wandb_project" if recipe.wandb_project else ("use_wandb" if recipe.use_wandb else "report_to")
        raise BackendUnavailableError(
            f"{key}: logging to Weights & Biases needs the wandb package, which is not installed; "
            f"{WANDB_INSTALL_HINT}, or remove the W&B keys."
        )


def tracker_environment(recipe: Recipe, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that configure the recipe's W&B run (empty without W&B)."""
    if "wandb" not in recipe.resolved_report_to:
        return {}
    settings = {
        "WANDB_PROJECT": recipe.wandb_project,
        "WANDB_ENTITY": recipe.wandb_entity,
        "WANDB_MODE": recipe.wandb_mode,
        "WANDB_RUN_ID": recipe.wandb_run_id,
        "WANDB_WATCH": recipe.wandb_watch,
        "WANDB_LOG_MODEL": recipe.wandb_log_model,
    }
    env = {name: value for name, value in settings.items() if value is not None}
    if "WANDB_DIR" not in environ:
        env["WANDB_DIR"] = recipe.output_dir
    return env


def recipe_callbacks(recipe: Recipe) -> list[Any]:
    """The Trainer callbacks the recipe's keys ask for."""
    if recipe.loss_watchdog_threshold is None:
        return []
    from cptune.run.training.watchdog import LossWatchdog

    return [LossWatchdog(recipe.loss_watchdog_threshold, recipe.loss_watchdog_patience)]
