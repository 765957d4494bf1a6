"""One process running ``cptune train`` and ``cptune evaluate`` as a launcher's rank runs them.

Usage: rank_exit_worker.py RECIPE; prints one JSON line.

``RANK`` and ``WORLD_SIZE`` are set, so each command runs in this process as a launched rank; the
training and the evaluation are replaced by stand-ins that start what the real ones start (cptune's
gloo group, a subgroup as a device mesh makes, collectives on both). After each command, the line
reports the gloo threads the stand-in saw, whether a process group was left, and the gloo threads
still running.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")
"""Names torch 2.13 gives the threads of a gloo group."""

started: list[list[str]] = []
"""The gloo threads running when each stand-in returned."""


def gloo_threads() -> list[str]:
    tasks = Path("/proc/self/task")
    return sorted(
        name for task in tasks.iterdir() if (name := (task / "comm").read_text().strip()) in GROUP_THREADS
    )


def start_groups() -> None:
    from cptune.run.training.distributed import init_cpu_process_group

    init_cpu_process_group(timeout_seconds=60)
    subgroup = dist.new_group([0])
    tensor = torch.ones(8)
    for _ in range(4):
        dist.all_reduce(tensor)
        dist.all_reduce(tensor, group=subgroup)
    started.append(gloo_threads())


def main() -> None:
    from cptune import cli
    from cptune.run.commands import evaluate as evaluate_module
    from cptune.run.launch.processes import free_port
    from cptune.run.training import train as train_module

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))

    def train(recipe, callbacks=(), *, plan=None, data_reported=False, overrides=()):
        start_groups()
        return train_module.TrainResult([], Path(recipe.output_dir), 0.0)

    def evaluate(recipe, checkpoint=None, *, plan=None):
        start_groups()
        return {"eval_loss": 0.0}

    train_module.train, evaluate_module.evaluate = train, evaluate
    report = {}
    for command in ("train", "evaluate"):
        cli.main([command, sys.argv[1]])
        report[command] = {
            "threads_started": started[-1],
            "group_left": dist.is_initialized(),
            "threads_left": gloo_threads(),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
