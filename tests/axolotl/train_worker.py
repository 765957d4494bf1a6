"""One rank of a launch that trains several recipes one after the other (one launch, not one per recipe).

Usage: train_worker.py OUT_DIR RECIPE [RECIPE ...]

Runs ``cptune.run.train.train`` on each recipe in turn, in the same processes (process start-up
dominates short CPU runs), and writes ``OUT_DIR/rank{r}.json`` with each run's logged losses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cptune.config.loader import load_recipe
from cptune.run.distributed import read_dist_env
from cptune.run.train import train


def main() -> None:
    out_dir, recipes = Path(sys.argv[1]), sys.argv[2:]
    losses = {recipe: train(load_recipe(recipe)).losses for recipe in recipes}
    (out_dir / f"rank{read_dist_env().rank}.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
