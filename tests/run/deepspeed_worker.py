"""One rank of tests/run/test_deepspeed_runs.py: train recipes one after the other in the same processes.

Usage: deepspeed_worker.py OUT_DIR RECIPE [RECIPE ...]

Runs ``cptune.run.training.train.train`` on each recipe in turn, as a notebook calling it twice would, and
writes ``OUT_DIR/rank{r}.json`` with, per recipe: the logged history, which of DeepSpeed's
process-wide globals the run left other than they were before the first run
(:func:`cptune.run.training.deepspeed_state.snapshot`), and under ZeRO-3 the parameters DeepSpeed kept
whole on this rank while training (none may be).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import TrainerCallback

from cptune.config.loader import load_recipe
from cptune.run.training.deepspeed_state import snapshot
from cptune.run.training.distributed import close_process_groups, read_dist_env
from cptune.run.training.train import train
from tests.parallel.zero3_partition import whole_parameters


class Partitioning(TrainerCallback):
    """At the start of training: the parameters a ZeRO-3 run keeps whole on this rank."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            self.seen = {
                "whole_parameters": whole_parameters(model.named_parameters(), args.world_size),
                "parameters": sum(1 for _ in model.parameters()),
            }


def main() -> None:
    out_dir, recipes = Path(sys.argv[1]), sys.argv[2:]
    before = snapshot()
    runs = {}
    for recipe in recipes:
        partitioning = Partitioning()
        result = train(load_recipe(recipe), callbacks=[partitioning])
        after = snapshot()
        runs[Path(recipe).stem] = {
            "history": result.log_history,
            "state_left": sorted(".".join(key) for key in before if after[key] != before[key]),
            **partitioning.seen,
        }
    (out_dir / f"rank{read_dist_env().rank}.json").write_text(json.dumps(runs))
    close_process_groups()  # as cptune's own ranks end


if __name__ == "__main__":
    main()
