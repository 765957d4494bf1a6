"""Experiment trackers from the recipe, the loss watchdog, and optimizers checked before launching."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from cptune.config.loader import validate_recipe
from cptune.errors import BackendUnavailableError
from cptune.run.training.optimizers import check_optimizer, optimizer_notes, required_package
from cptune.run.training.tracking import check_trackers, recipe_callbacks, tracker_environment
from cptune.run.training.watchdog import LossWatchdog


def recipe(**keys):
    return validate_recipe(
        {"base_model": "m", "datasets": [{"path": "d.jsonl"}], "output_dir": "out", **keys}
    )


def test_wandb_settings_become_the_environment_the_trainer_reads():
    wandb = recipe(wandb_project="p", wandb_entity="team", wandb_mode="offline", wandb_watch="gradients")
    assert tracker_environment(wandb, {}) == {
        "WANDB_PROJECT": "p",
        "WANDB_ENTITY": "team",
        "WANDB_MODE": "offline",
        "WANDB_WATCH": "gradients",
        "WANDB_DIR": "out",
    }
    assert tracker_environment(wandb, {"WANDB_DIR": "/elsewhere"}).get("WANDB_DIR") is None
    # W&B keys without wandb_project or use_wandb change nothing.
    assert tracker_environment(recipe(wandb_entity="team"), {}) == {}


def test_wandb_missing_is_refused(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name))
    with pytest.raises(BackendUnavailableError) as error:
        check_trackers(recipe(wandb_project="p"))
    assert str(error.value) == (
        "wandb_project: logging to Weights & Biases needs the wandb package, which is not installed; "
        "pip install 'cptune[wandb]', or remove the W&B keys."
    )
    check_trackers(recipe())  # no W&B: nothing to check


def test_loss_watchdog_stops_after_patience_logs_above_the_threshold():
    assert recipe_callbacks(recipe()) == []
    (watchdog,) = recipe_callbacks(recipe(loss_watchdog_threshold=5.0, loss_watchdog_patience=2))
    assert isinstance(watchdog, LossWatchdog)
    state = SimpleNamespace(is_world_process_zero=True, global_step=1)
    stops = []
    for loss in (6.0, 4.0, 6.0, 7.0):
        control = SimpleNamespace(should_training_stop=False)
        watchdog.on_log(None, state, control, logs={"loss": loss})
        stops.append(control.should_training_stop)
    assert stops == [False, False, False, True]  # two logs in a row above 5.0, not two in all
    control = SimpleNamespace(should_training_stop=False)
    watchdog.on_log(None, state, control, logs={"eval_loss": 9.0})  # evaluation logs do not count
    assert not control.should_training_stop


def test_optimizers_are_refused_only_where_they_cannot_run(monkeypatch):
    assert required_package("paged_adamw_8bit")[0] == "bitsandbytes"
    assert required_package("adamw_torch_8bit")[0] == "torchao"
    assert required_package("adamw_torch_fused") is None
    with pytest.raises(BackendUnavailableError, match="adamw_torch_npu_fused runs on Ascend NPUs"):
        check_optimizer(recipe(optimizer="adamw_torch_npu_fused"))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name)
    )
    with pytest.raises(BackendUnavailableError) as error:
        check_optimizer(recipe(optimizer="adamw_torch_8bit"))
    assert str(error.value) == (
        "optimizer: adamw_torch_8bit needs the torchao package, which is not installed; "
        "pip install 'torchao>=0.4', or use adamw_torch."
    )
    check_optimizer(recipe(optimizer="adamw_torch"))
    assert "runs unpaged on CPU" in optimizer_notes(recipe(optimizer="paged_adamw_8bit"), cuda=False)[0]
    assert optimizer_notes(recipe(optimizer="paged_adamw_8bit"), cuda=True) == []
