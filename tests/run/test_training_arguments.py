"""Recipe keys that reach the Trainer's arguments unchanged."""

from __future__ import annotations

import logging

from cptune.config.loader import load_recipe
from cptune.parallel.layout import ParallelDims
from cptune.run.distributed import DistEnv
from cptune.run.train import training_arguments


def test_ddp_timeout_reaches_the_trainer(write_recipe):
    recipe = load_recipe(write_recipe(ddp_timeout=60))
    args = training_arguments(recipe, ParallelDims(world_size=1, cp_size=1), DistEnv())
    assert args.ddp_timeout == 60
    default = load_recipe(write_recipe("default.yaml"))
    assert training_arguments(default, ParallelDims(world_size=1, cp_size=1), DistEnv()).ddp_timeout == 1800


def test_ddp_timeout_that_cpu_runs_cannot_apply_is_named(write_recipe, caplog, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    # Building real arguments for 2 processes would need their process group; the warning comes first.
    monkeypatch.setattr("transformers.TrainingArguments", lambda **kwargs: kwargs)
    recipe = load_recipe(write_recipe(ddp_timeout=60, context_parallel_size=2))
    with caplog.at_level(logging.WARNING, logger="cptune"):
        args = training_arguments(
            recipe, ParallelDims(world_size=2, cp_size=2), DistEnv(rank=0, world_size=2)
        )
    assert args["ddp_timeout"] == 60
    assert "ddp_timeout: 60 s is not applied on CPU" in caplog.text
