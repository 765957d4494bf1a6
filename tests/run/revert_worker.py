"""One rank: train() with cp=2 leaves no patch and no environment variable behind, after success and after an exception.

Usage: revert_worker.py OUT_DIR RECIPE
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from cptune.config.loader import load_recipe
from cptune.parallel.backends.table import BACKENDS
from cptune.patches.core import Target
from cptune.patches.registry import build_patches
from cptune.run.training import train as train_module
from cptune.run.training.distributed import close_process_groups


def raw_object(target: Target) -> object:
    """What is stored at the target right now (not what attribute lookup finds)."""
    node = importlib.import_module(target.module)
    for part in target.path[:-1]:
        node = getattr(node, part)
    if target.key is not None:
        return getattr(node, target.path[-1]).get(target.key, "<absent>")
    return vars(node).get(target.path[-1], "<absent>")


def snapshot(recipe) -> dict[str, int]:
    return {
        p.target: id(raw_object(Target.parse(p.target)))
        for p in build_patches(BACKENDS[recipe.cp_backend], BACKENDS.values())
    }


def main() -> None:
    out_dir, recipe_path = Path(sys.argv[1]), sys.argv[2]
    recipe = load_recipe(recipe_path)
    before = snapshot(recipe)
    env_before = dict(os.environ)
    built = []
    build = train_module.build_trainer
    train_module.build_trainer = lambda *args, **kwargs: built.append(build(*args, **kwargs)) or built[-1]
    train_module.train(recipe)
    train_module.build_trainer = build
    accelerator = built[0].accelerator
    # A guard a patch put on the run's accelerator would outlive the patches (it once did).
    cp_context_left = "_cp_context" in vars(accelerator) or hasattr(type(accelerator), "_cp_context")
    after_success = snapshot(recipe)
    env_after_success = dict(os.environ)
    # The first run finished in output_dir: the second starts afresh there only when told to.
    recipe = recipe.model_copy(update={"overwrite_output_dir": True})

    def fail(*args, **kwargs):
        raise RuntimeError("simulated failure after the patches were applied")

    train_module.build_trainer = fail
    try:
        train_module.train(recipe)
        raised = False
    except RuntimeError:
        raised = True
    after_failure = snapshot(recipe)
    env_after_failure = dict(os.environ)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    (out_dir / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "targets": sorted(before),
                "same_after_success": before == after_success,
                "same_after_failure": before == after_failure,
                "raised": raised,
                "env_same_after_success": env_before == env_after_success,
                "env_same_after_failure": env_before == env_after_failure,
                "env_leaked": sorted(set(env_after_success) ^ set(env_before)),
                "cp_context_left": cp_context_left,
            }
        )
    )
    close_process_groups()  # as cptune's own ranks end


if __name__ == "__main__":
    main()
