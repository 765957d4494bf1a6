"""One rank of a launch that trains one or more cptune recipes, for the checkpoint and FSDP tests.

Usage: train_worker.py OUT_DIR RECIPE [RECIPE ...] [--crash-saving-step N]

Runs ``cptune.run.training.train.train`` on each recipe in turn, in the same processes (process
start-up dominates short CPU runs: one launch, not one per recipe). Without
``--crash-saving-step``, rank 0 then writes each trained model's logits for a fixed
input, computed with the unwrapped model in a plain forward over the whole input (no CP;
every rank joins in when the model is sharded with FSDP2), to ``logits.pt`` in that
recipe's output_dir. Each rank writes ``OUT_DIR/rank{r}.json``: ``{"runs": [report per
recipe]}``; its log, ``OUT_DIR/rank{r}.log``, holds what the runs logged (rank 0 at INFO, as
``cptune train``'s rank 0), each run's part between the lines :data:`RUN_STARTS` and :data:`RUN_ENDS`. With ``--crash-saving-step``, every rank kills itself with SIGKILL while the
Trainer is writing checkpoint N (after the model files, before the optimizer state), like
a machine that goes down mid-save.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import torch

from cptune.config.loader import load_recipe
from cptune.run.training import train as train_module
from cptune.run.training.distributed import close_process_groups, read_dist_env
from cptune.run.training.unused_imports import leave_out_bitsandbytes

# The lines around what a run logs (a test reads one run's part of a launch's log: tests/run/one_process.py).
RUN_STARTS = "train_worker: training {recipe}"
RUN_ENDS = "train_worker: trained {recipe}"
FIXED_TEXT = "### Instruction:\nName a colour of the sea.\n\n### Response:\nBlue, green or grey."


def fixed_input_ids(tokenizer) -> torch.Tensor:
    return tokenizer(FIXED_TEXT, return_tensors="pt").input_ids


def main() -> None:
    args = sys.argv[1:]
    crash_step = None
    if "--crash-saving-step" in args:
        at = args.index("--crash-saving-step")
        crash_step = int(args[at + 1])
        del args[at : at + 2]
    out_dir, recipes = Path(args[0]), args[1:]
    # As cptune's own ranks do (cptune/cli.py): rank 0 logs at INFO (what the runs say, in rankN.log)...
    rank = read_dist_env().rank
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    # ...and this process trains these recipes only.
    leave_out_bitsandbytes([load_recipe(recipe) for recipe in recipes])
    reports = []
    for recipe in recipes:
        mark(RUN_STARTS.format(recipe=recipe))
        reports.append(train_one(recipe, crash_step))
        mark(RUN_ENDS.format(recipe=recipe))
    (out_dir / f"rank{read_dist_env().rank}.json").write_text(json.dumps({"runs": reports}))
    close_process_groups()  # as cptune's own ranks end


def mark(line: str) -> None:
    """Write ``line`` to the log after everything the process wrote before it (stdout is block-buffered)."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def train_one(recipe_path: str, crash_step: int | None) -> dict:
    """Train ``recipe_path``; rank 0 saves the trained model's logits in its output_dir; returns the report."""
    built = {}
    build = train_module.build_trainer

    def build_and_keep(*args, **kwargs):
        trainer = build(*args, **kwargs)
        built["trainer"] = trainer
        if crash_step is not None:
            save_optimizer = trainer._save_optimizer_and_scheduler

            def crash_while_saving(output_dir):
                if trainer.state.global_step == crash_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                save_optimizer(output_dir)

            trainer._save_optimizer_and_scheduler = crash_while_saving
        return trainer

    train_module.build_trainer = build_and_keep
    try:
        result = train_module.train(load_recipe(recipe_path))
    finally:
        train_module.build_trainer = build
    rank = read_dist_env().rank
    trainer = built["trainer"]
    # Measured before the forward below: FSDP2 keeps the root's and the output layer's weights
    # gathered after a forward until the next backward.
    report = {"losses": result.losses, "gloo_worker_threads": gloo_worker_threads(), **state_bytes(trainer)}
    # A model sharded with FSDP2 gathers its weights in the forward: every rank takes part.
    if rank == 0 or trainer.is_fsdp_enabled:
        model = trainer.accelerator.unwrap_model(trainer.model)
        # cptune's CP attention needs per-batch metadata; a plain forward uses sdpa on the whole input
        # (eager where the model has no sdpa: gpt-oss, whose sinks sdpa cannot add).
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        model.set_attn_implementation("sdpa" if base._supports_sdpa else "eager")
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=fixed_input_ids(trainer.processing_class)).logits
        if rank == 0:
            torch.save(logits, Path(result.output_dir) / "logits.pt")
    return report


def gloo_worker_threads() -> list[int]:
    """The worker threads of each gloo process group this rank has (the world's, the device mesh's...).

    cptune's run builds them with one (the patch ``gloo-one-worker-thread``): two workers of a group write
    its status string together, issue 26's heap corruption.
    """
    import torch.distributed.distributed_c10d as c10d

    threads = []
    for group in list(c10d._world.pg_map):
        if torch.device("cpu") in group._device_types:
            options = group._get_backend(torch.device("cpu")).options
            threads.append(getattr(options, "_threads", None))  # None: not a gloo backend
    return threads


def state_bytes(trainer) -> dict[str, int]:
    """Bytes of weights and optimizer state this rank holds, and of the whole model's weights."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = list(trainer.model.parameters())
    moments = [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    return {
        "weight_bytes": sum(local(p).numel() * p.element_size() for p in params),
        "optimizer_bytes": sum(local(v).numel() * v.element_size() for v in moments if v.dim() > 0),
        "model_weight_bytes": sum(p.numel() * p.element_size() for p in params),
        "trained_dtypes": sorted({str(p.dtype) for p in params if p.requires_grad}),
        "frozen_dtypes": sorted({str(p.dtype) for p in params if not p.requires_grad}),
        "fsdp_compute_dtype": str(getattr(policy, "param_dtype", None)),
    }


if __name__ == "__main__":
    main()
