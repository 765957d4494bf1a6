"""Recipe keys that reach the Trainer's arguments unchanged."""

from __future__ import annotations

from cptune.config.loader import load_recipe
from cptune.run.plan import RunPlan
from cptune.run.training.builder import training_arguments
from cptune.run.training.distributed import DistEnv


def test_ddp_timeout_reaches_the_trainer(write_recipe):
    recipe = load_recipe(write_recipe(ddp_timeout=60))
    args = training_arguments(RunPlan.build(recipe, 1), DistEnv())
    assert args.ddp_timeout == 60
    default = load_recipe(write_recipe("default.yaml"))
    assert training_arguments(RunPlan.build(default, 1), DistEnv()).ddp_timeout == 1800


def test_ddp_find_unused_parameters_reaches_the_trainer(write_recipe):
    """Off unless the recipe asks (left unset, the Trainer would choose, and search for most models)."""
    for value in (True, False):
        recipe = load_recipe(write_recipe(ddp_find_unused_parameters=value))
        assert training_arguments(RunPlan.build(recipe, 1), DistEnv()).ddp_find_unused_parameters is value
    default = load_recipe(write_recipe("default.yaml"))
    assert default.ddp_find_unused_parameters is False
    assert training_arguments(RunPlan.build(default, 1), DistEnv()).ddp_find_unused_parameters is False


def test_axolotl_keys_reach_the_trainer(write_recipe):
    recipe = load_recipe(
        write_recipe(
            optimizer="adamw_bnb_8bit",
            optim_args={"block_size": 128},
            tf32=True,
            val_set_size=0.1,
            evals_per_epoch=4,
            saves_per_epoch=2,
            wandb_project="p",
            wandb_name="run-1",
            use_tensorboard=True,
            max_grad_norm=None,  # empty: the default, 1.0
        )
    )
    args = training_arguments(RunPlan.build(recipe, 1), DistEnv())
    assert (args.optim, args.optim_args) == ("adamw_bnb_8bit", "block_size=128")
    assert args.tf32 is None  # TF32 exists on NVIDIA GPUs only; the Trainer refuses tf32: true elsewhere
    assert (args.eval_strategy, args.eval_steps) == ("steps", 0.25)
    assert (args.save_strategy, args.save_steps) == ("steps", 0.5)
    assert sorted(args.report_to) == ["tensorboard", "wandb"] and args.run_name == "run-1"
    assert args.max_grad_norm == 1.0


def test_no_pinned_memory_and_no_progress_bar_off_a_terminal(write_recipe, monkeypatch):
    """Without a GPU nothing is pinned (torch warned once per rank under DeepSpeed, whose runs on CPU are
    not use_cpu); with stderr in a file the Trainer prints each log as a line instead of redrawing a bar."""
    import io
    import sys

    import pytest

    pytest.importorskip("deepspeed")  # installed by scripts/test.sh (the deepspeed extra)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    recipe = load_recipe(write_recipe(context_parallel_size=2, cp_backend="deepspeed"))
    args = training_arguments(RunPlan.build(recipe, 2), DistEnv(world_size=2, local_world_size=2))
    assert args.use_cpu is False  # DeepSpeed's engine: the Trainer does not know it runs on CPU
    assert args.dataloader_pin_memory is False
    assert args.disable_tqdm is True


def test_adams_betas_and_epsilon_reach_the_optimizer(write_recipe):
    from transformers import Trainer

    recipe = load_recipe(write_recipe(adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6))
    args = training_arguments(RunPlan.build(recipe, 1), DistEnv())
    optimizer, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert optimizer.__name__ == "AdamW"
    assert (kwargs["betas"], kwargs["eps"]) == ((0.8, 0.95), 1e-6)
    # Unset, they are the Trainer's own defaults.
    default = training_arguments(RunPlan.build(load_recipe(write_recipe("default.yaml")), 1), DistEnv())
    assert (default.adam_beta1, default.adam_beta2, default.adam_epsilon) == (0.9, 0.999, 1e-8)


def test_axolotls_cosine_min_lr_ratio_ends_the_cosine_at_that_share_of_the_peak(write_recipe):
    """The Trainer's cosine_with_min_lr gives, step by step, the factor Axolotl's get_cosine_schedule_with_min_lr
    computes (axolotl/utils/schedulers.py): linear warmup, then (1 - ratio) * 0.5 * (1 + cos(pi * progress)) + ratio."""
    import math

    import torch
    from transformers import get_scheduler

    ratio, warmup, steps = 0.1, 2, 10
    recipe = load_recipe(
        write_recipe(lr_scheduler="cosine", cosine_min_lr_ratio=ratio, warmup_steps=warmup, max_steps=steps)
    )
    args = training_arguments(RunPlan.build(recipe, 1), DistEnv())
    assert (args.lr_scheduler_type, args.lr_scheduler_kwargs) == (
        "cosine_with_min_lr",
        {"min_lr_rate": ratio},
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs,
    )

    def axolotls(step: int) -> float:
        if step < warmup:
            return step / warmup
        progress = (step - warmup) / (steps - warmup)
        return (1 - ratio) * (0.5 * (1.0 + math.cos(math.pi * progress))) + ratio

    factors = []
    for _ in range(steps + 1):
        factors.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert factors == [axolotls(step) for step in range(steps + 1)]
    assert factors[-1] == ratio
    # Without it, the plain cosine to 0.
    plain = training_arguments(RunPlan.build(load_recipe(write_recipe("plain.yaml")), 1), DistEnv())
    assert (plain.lr_scheduler_type, plain.lr_scheduler_kwargs) == ("cosine", {})


def test_eval_batch_size_reaches_the_trainer_and_defaults_to_micro_batch_size(write_recipe):
    """Axolotl's eval_batch_size: rows per evaluation forward (the eval dataloader reads args.eval_batch_size)."""
    recipe = load_recipe(write_recipe(micro_batch_size=2, eval_batch_size=4, val_set_size=0.1))
    args = training_arguments(RunPlan.build(recipe, 1), DistEnv())
    assert (args.per_device_train_batch_size, args.per_device_eval_batch_size, args.eval_batch_size) == (
        2,
        4,
        4,
    )
    default = load_recipe(write_recipe("default.yaml", micro_batch_size=2))
    assert training_arguments(RunPlan.build(default, 1), DistEnv()).per_device_eval_batch_size == 2
