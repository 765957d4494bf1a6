"""Rank worker of the sharding benchmark: the model-state bytes one rank holds while it trains.

Usage: ``python -m benchmarks.workers.state_worker OUT_DIR RECIPE_YAML``

Trains the recipe through :func:`cptune.run.training.train.train` with a :class:`StateProbe`,
which counts, on the last optimizer step, the bytes of this rank's own part of
the weights, of the gradients (just before the optimizer step, when they all
exist) and of the optimizer state (after it). A tensor sharded with FSDP2 is a
DTensor; only its local shard counts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from benchmarks.common import write_rank_report


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (the local shard of a DTensor)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


class StateProbe(TrainerCallback):
    """Counts weights, gradients and optimizer state of this rank at every optimizer step."""

    def __init__(self) -> None:
        self.gradients = 0
        self.record: dict[str, Any] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.gradients = local_bytes(p.grad for p in model.parameters() if p.grad is not None)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        moments = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        self.record = {
            "step": state.global_step,
            "weights": local_bytes(model.parameters()),
            "gradients": self.gradients,
            "optimizer": local_bytes(moments),
            "model_parameters": sum(p.numel() for p in model.parameters()),
        }


def main() -> None:
    out_dir, recipe_path = sys.argv[1], Path(sys.argv[2])
    from cptune.config.loader import load_recipe
    from cptune.run.training.distributed import read_dist_env
    from cptune.run.training.train import train

    probe = StateProbe()
    train(load_recipe(recipe_path), callbacks=[probe])
    if not probe.record:
        raise SystemExit("the state probe recorded nothing: the Trainer never reached it")
    write_rank_report(out_dir, read_dist_env().rank, probe.record)


if __name__ == "__main__":
    main()
