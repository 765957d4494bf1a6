"""Recipe keys that reach the Trainer's arguments unchanged."""

from __future__ import annotations

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
