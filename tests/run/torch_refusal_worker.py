"""One rank: train() with cp_backend: torch refuses packed and padded batches before any step runs.

The recipes are built from their keys without the loader's combination rules
(which already refuse sample_packing, and pad_to_sequence_len with causal:
false, for this backend), so what is tested is the second line of defence: the
backend's check of every batch inside the real Trainer. Global hooks count model
forwards and optimizer steps while train() runs: neither may happen.

Usage: torch_refusal_worker.py OUT_DIR RECIPE_YAML...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml
from torch.optim.optimizer import register_optimizer_step_pre_hook

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError
from cptune.run.training.distributed import close_process_groups
from cptune.run.training.train import train


def refusal(recipe: Recipe) -> dict:
    counts = {"forwards": 0, "optimizer_steps": 0}

    def count_forward(module, args):
        counts["forwards"] += 1

    def count_step(optimizer, args, kwargs):
        counts["optimizer_steps"] += 1

    forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(count_forward)
    step_hook = register_optimizer_step_pre_hook(count_step)
    try:
        train(recipe)
        error = None
    except CptuneError as err:
        error = f"{type(err).__name__}: {err}"
    finally:
        forward_hook.remove()
        step_hook.remove()
    return {
        "error": error,
        **counts,
        "wrote_train_log": (Path(recipe.output_dir) / "train_log.json").exists(),
    }


def main() -> None:
    out_dir, recipe_paths = Path(sys.argv[1]), sys.argv[2:]
    results = {path: refusal(Recipe(**yaml.safe_load(Path(path).read_text()))) for path in recipe_paths}
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    close_process_groups()  # as cptune's own ranks end


if __name__ == "__main__":
    main()
