"""One rank of a launch that trains several recipes one after the other (one launch, not one per recipe).

Usage: train_worker.py OUT_DIR RECIPE [RECIPE ...]

Runs ``cptune.run.train.train`` on each recipe in turn, in the same processes (process start-up
dominates short CPU runs), and writes ``OUT_DIR/rank{r}.json`` with each run's logged losses and
what the model trained with (:class:`Setup`).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from transformers import TrainerCallback

from cptune.config.loader import load_recipe
from cptune.run.distributed import close_process_groups, read_dist_env
from cptune.run.train import train


class Setup(TrainerCallback):
    """At the start of training: whether DeepSpeed ZeRO-3 partitions every parameter, and the memory
    features' hooks on the model (modules hooked by ``TiledMlp`` / ``HeadLoss``)."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        owners = Counter(
            type(getattr(hook, "__self__", None)).__name__
            for module in model.modules()
            for hook in module._forward_hooks.values()
        )
        self.seen = {
            "zero3_partitioned": all(hasattr(p, "ds_id") for p in model.parameters()),
            "tiled_mlp_modules": owners["TiledMlp"],
            "head_loss_modules": owners["HeadLoss"],
        }


def main() -> None:
    out_dir, recipes = Path(sys.argv[1]), sys.argv[2:]
    runs = {}
    for recipe in recipes:
        setup = Setup()
        runs[recipe] = {"losses": train(load_recipe(recipe), callbacks=[setup]).losses, **setup.seen}
    (out_dir / f"rank{read_dist_env().rank}.json").write_text(json.dumps(runs))
    close_process_groups()  # as cptune's own ranks end


if __name__ == "__main__":
    main()
