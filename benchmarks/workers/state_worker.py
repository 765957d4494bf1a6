"""Rank worker of the sharding benchmark: the model-state bytes one rank holds while it trains.

Usage: ``python -m benchmarks.workers.state_worker OUT_DIR RECIPE_YAML``

Trains the recipe through :func:`cptune.run.training.train.train` with a :class:`~benchmarks.workers.probes.StateProbe`,
which counts, on the last optimizer step, the bytes of this rank's own part of
the weights, of the gradients (just before the optimizer step, when they all
exist) and of the optimizer state (after it). A tensor sharded with FSDP2 is a
DTensor; only its local shard counts.
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.common import write_rank_report


def main() -> None:
    out_dir, recipe_path = sys.argv[1], Path(sys.argv[2])
    from cptune.config.loader import load_recipe
    from cptune.run.training.distributed import read_dist_env
    from cptune.run.training.train import train
    from cptune.run.training.unused_imports import leave_out_bitsandbytes

    recipe = load_recipe(recipe_path)
    leave_out_bitsandbytes([recipe])  # as a rank of `cptune train` does, before transformers is imported
    from benchmarks.workers.probes import StateProbe

    probe = StateProbe()
    train(recipe, callbacks=[probe])
    if not probe.record:
        raise SystemExit("the state probe recorded nothing: the Trainer never reached it")
    write_rank_report(out_dir, read_dist_env().rank, probe.record)


if __name__ == "__main__":
    main()
