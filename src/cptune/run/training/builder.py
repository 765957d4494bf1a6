"""The Trainer of a run, its arguments and the scope it runs in, built from the run's plan: shared by train and
evaluate."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from cptune.console import draws_progress_bars
from cptune.models.head_loss import ShardLoss, logits_loss
from cptune.run.plan import RunPlan
from cptune.run.training.deepspeed_state import deepspeed_state_restored
from cptune.run.training.distributed import DistEnv, init_cpu_process_group
from cptune.run.training.fsdp import fsdp_training_arguments

if TYPE_CHECKING:
    from cptune.data.prepare import PreparedData
    from cptune.run.training.trainer import BackendFactory, CptuneTrainer


@contextlib.contextmanager
def run_scope(plan: RunPlan) -> Iterator[None]:
    """The run's patches applied, and DeepSpeed's process-wide state put back when the block ends.

    Enter it around everything from building the Trainer on (training or evaluating).
    """
    with deepspeed_state_restored(plan.on_deepspeed), plan.patches.applied(plan.recipe):
        yield


def training_arguments(plan: RunPlan, env: DistEnv) -> Any:
    """The Trainer's arguments for the plan's recipe and process layout."""
    from transformers import TrainingArguments

    recipe = plan.recipe
    pieces = plan.trainer_parallelism()
    parallelism, deepspeed = pieces.parallelism, pieces.deepspeed
    warmup: float = 0
    if recipe.warmup_steps is not None:
        warmup = recipe.warmup_steps
    elif recipe.warmup_ratio is not None:
        warmup = recipe.warmup_ratio
    eval_steps, save_steps = recipe.resolved_eval_steps, recipe.resolved_save_steps
    scheduler, scheduler_kwargs = recipe.resolved_lr_scheduler
    on_cpu = not torch.cuda.is_available()
    return TrainingArguments(
        output_dir=recipe.output_dir,
        per_device_train_batch_size=recipe.micro_batch_size,
        per_device_eval_batch_size=recipe.resolved_eval_batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        num_train_epochs=recipe.num_epochs,
        max_steps=recipe.max_steps or -1,
        learning_rate=recipe.learning_rate,
        optim=recipe.optimizer,
        optim_args=recipe.resolved_optim_args,
        optim_target_modules=list(recipe.optim_target_modules) if recipe.optim_target_modules else None,
        lr_scheduler_type=scheduler,
        lr_scheduler_kwargs=scheduler_kwargs,
        warmup_steps=warmup,
        weight_decay=recipe.weight_decay,
        max_grad_norm=recipe.max_grad_norm,
        **recipe.adam_arguments,
        seed=recipe.seed,
        data_seed=recipe.seed,
        bf16=recipe.bf16 is True or (recipe.bf16 == "auto" and torch.cuda.is_available()),
        fp16=recipe.fp16,
        # TF32 exists on NVIDIA GPUs only (the Trainer refuses tf32: true elsewhere).
        tf32=recipe.tf32 if torch.cuda.is_available() else None,
        logging_steps=recipe.logging_steps,
        logging_first_step=True,
        save_strategy=recipe.resolved_save_strategy,
        save_steps=save_steps or 500,
        save_total_limit=recipe.save_total_limit,
        eval_strategy=recipe.resolved_eval_strategy,
        eval_steps=eval_steps,
        report_to=list(recipe.resolved_report_to) or "none",
        run_name=recipe.wandb_name,
        remove_unused_columns=False,
        # Under CP each rank holds logits for its shard only; evaluation reports the loss.
        prediction_loss_only=True,
        label_names=["labels"],
        dataloader_num_workers=recipe.dataloader_num_workers,
        # With use_cpu accelerate never selects DeepSpeed (accelerate/state.py:974); on CPU a patch
        # (patches/deepspeed_patches.py) gives DeepSpeed processes the gloo backend instead.
        use_cpu=on_cpu and deepspeed is None,
        ddp_backend="gloo" if on_cpu and env.world_size > 1 else None,
        parallelism_config=parallelism,
        deepspeed=deepspeed,
        # Pinned host memory speeds up copies to a GPU; without one torch warns that it cannot pin.
        dataloader_pin_memory=torch.cuda.is_available(),
        # Rank 0 draws the bar, on a terminal; elsewhere the Trainer prints each log as one line.
        disable_tqdm=env.rank != 0 or not draws_progress_bars(),
        # transformers' info level dumps model configs; cptune logs what matters itself.
        log_level="warning",
        log_level_replica="error",
        # Unless the recipe asks for it: the model is the same on every step, no extra autograd traversal per step.
        ddp_find_unused_parameters=bool(recipe.ddp_find_unused_parameters),
        # A collective that waits longer than this fails the run instead of holding it forever.
        ddp_timeout=recipe.ddp_timeout,
        **fsdp_training_arguments(recipe, plan.dims),
    )


def build_trainer(
    plan: RunPlan,
    env: DistEnv,
    model: Any,
    tokenizer: Any,
    prepared: PreparedData,
    backend_factory: BackendFactory,
    shard_loss: ShardLoss = logits_loss,
    *,
    training: bool = True,
    model_is_reference: bool = True,
) -> CptuneTrainer:
    """cptune's Trainer for the plan, on the prepared data, sharding each batch with ``backend_factory``'s sharder.

    A recipe with ``rl`` gets the :class:`~cptune.run.training.preference_trainer.PreferenceTrainer`; with
    ``precompute_ref_log_probs`` its first pass's sums are stored with the prepared data
    (:mod:`cptune.run.training.reference_cache`). ``training`` is False under ``cptune evaluate``;
    ``model_is_reference`` False where ``model`` is a saved full fine-tune, whose reference is the base model.

    Call it with the plan's patches applied. Starts the process group on CPU (gloo), unless
    DeepSpeed's engine starts its own.
    """
    from cptune.data.collator import PackedCollator
    from cptune.run.training.trainer import CptuneTrainer

    recipe, dims = plan.recipe, plan.dims
    if env.world_size > 1 and not torch.cuda.is_available() and not plan.on_deepspeed:
        # DeepSpeed's engine (Ulysses, or ring / torch CP under ZeRO) starts its process group itself.
        init_cpu_process_group(recipe.ddp_timeout)
    collator = PackedCollator.for_recipe(recipe, tokenizer.pad_token_id)
    trainer_class, extra = CptuneTrainer, {}
    if recipe.is_preference:
        from cptune.parallel.preference import PreferenceLoss
        from cptune.run.training.preference_trainer import PreferenceTrainer
        from cptune.run.training.reference_cache import ReferenceStore

        trainer_class, extra = (
            PreferenceTrainer,
            {
                "preference_loss": PreferenceLoss.from_recipe(recipe),
                "precompute_reference": recipe.precompute_ref_log_probs,
                "reference_store": ReferenceStore.for_recipe(recipe, prepared.path)
                if recipe.precompute_ref_log_probs
                else None,
                "training": training,
                "model_is_reference": model_is_reference,
            },
        )
    return trainer_class(
        model=model,
        args=training_arguments(plan, env),
        train_dataset=prepared.train,
        eval_dataset=prepared.eval,
        data_collator=collator,
        processing_class=tokenizer,
        backend_factory=backend_factory,
        cp_size=dims.cp_size,
        tp_size=dims.tp_size,
        shard_loss=shard_loss,
        **extra,
    )
