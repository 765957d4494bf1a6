"""One rank of a launch that trains several recipes one after the other (one launch, not one per recipe).

Usage: train_worker.py OUT_DIR RECIPE [RECIPE ...]

Runs ``cptune.run.training.train.train`` on each recipe in turn, in the same processes (process start-up
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
from cptune.run.training.distributed import close_process_groups, read_dist_env
from cptune.run.training.train import train
from tests.parallel.zero3_partition import whole_parameters


class Setup(TrainerCallback):
    """At the start of training: the parameters DeepSpeed ZeRO-3 keeps whole on this rank (None without
    ZeRO-3), and the memory features' hooks on the model (modules hooked by ``TiledMlp`` / ``HeadLoss``)."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        owners = Counter(
            type(getattr(hook, "__self__", None)).__name__
            for module in model.modules()
            for hook in module._forward_hooks.values()
        )
        zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
        self.seen = {
            "zero3_whole": whole_parameters(model.named_parameters(), args.world_size) if zero3 else None,
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
