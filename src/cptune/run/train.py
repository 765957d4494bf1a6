"""``train(recipe)``: wire data, model, backend, patches and the Trainer for one process.

This runs inside every process of a launch (torchrun or cptune's own launcher),
or alone for a single-process run. It owns the lifetime of the patch set: every
patch is applied before the Trainer is built and reverted when training returns
or raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cptune.atomic import write_text
from cptune.config.recipe import Recipe
from cptune.models.head_loss import logits_loss
from cptune.models.loading import (
    apply_lora,
    check_token_ids,
    load_model,
    load_tokenizer,
    trainable_parameter_count,
)
from cptune.models.memory_features import install_memory_features
from cptune.parallel.backends.select import check_model_config, check_prepared_rows, plan_backend
from cptune.parallel.backends.table import backend_for
from cptune.parallel.backends.zero import trains_on_deepspeed
from cptune.parallel.layout import ParallelDims
from cptune.run.checkpoints import resume_checkpoint
from cptune.run.deepspeed_state import deepspeed_state_restored
from cptune.run.distributed import DistEnv, init_cpu_process_group, read_dist_env
from cptune.run.fsdp import fsdp_training_arguments
from cptune.run.output_dir import TRAIN_LOG_NAME, check_earlier_run, check_output_dir, clear_earlier_run

log = logging.getLogger("cptune.train")


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports: per-step logs and where the model went."""

    log_history: list[dict[str, Any]]
    output_dir: Path
    seconds: float

    @property
    def losses(self) -> list[float]:
        return [entry["loss"] for entry in self.log_history if "loss" in entry]


def train(recipe: Recipe, callbacks: Sequence[Any] = ()) -> TrainResult:
    """Fine-tune as the recipe says, in this process (one rank of the launch).

    Environment variables that the libraries set while training (accelerate's
    and transformers' own settings) and DeepSpeed's process-wide state are restored
    when this returns or raises, as the patches are: a second run in the same process
    starts from the same state.

    Args:
        recipe: The validated recipe.
        callbacks: ``transformers.TrainerCallback`` objects added to the Trainer (e.g. to
            measure steps); they see the model as trained (wrapped, and sharded with FSDP2).
    """
    with _restored_environment():
        return _train(recipe, callbacks)


def _train(recipe: Recipe, callbacks: Sequence[Any]) -> TrainResult:
    from transformers import set_seed

    from cptune.config.compat_rules import axolotl_notes
    from cptune.data.prepare import highest_token_id, prepare_datasets
    from cptune.models.tokens import fit_embeddings
    from cptune.run.tracking import recipe_callbacks, tracker_environment

    env = read_dist_env()
    dims = ParallelDims.from_recipe(recipe, env.world_size)
    started = time.perf_counter()
    # W&B reads its settings from the environment; _restored_environment puts it back afterwards.
    os.environ.update(tracker_environment(recipe, os.environ))
    if env.rank == 0:
        for note in axolotl_notes(recipe):
            log.info("note: %s", note)
    # The launcher's preflight checked this too; under an external launcher (torchrun) it is the
    # first check, and it runs before anything is loaded or written.
    check_output_dir(recipe)
    check_earlier_run(recipe)
    if env.rank == 0:
        clear_earlier_run(recipe)

    tokenizer = load_tokenizer(recipe)
    prepared = prepare_datasets(recipe, tokenizer)
    check_prepared_rows(recipe, prepared)
    if env.rank == 0:
        log.info("%s", prepared.stats.format())

    if recipe.is_fsdp and not dims.sharded:
        log.info("fsdp_version: 2 with one process: there is nothing to shard; training without FSDP")
    backend = plan_backend(recipe, dims, tokenizer.pad_token_id)
    if recipe.offloads_activations:  # under torchrun no preflight ran: check before loading
        from cptune.run.memory_plan import check_host_memory
        from cptune.run.preflight import model_config

        check_host_memory(recipe, model_config(recipe), env.local_world_size)
    model = load_model(recipe, backend.attn_implementation, local_rank=env.local_rank)
    check_model_config(recipe, dims, model.config, type(model))
    fit_embeddings(model, tokenizer, recipe.seed)
    check_token_ids(highest_token_id(prepared), model.get_input_embeddings().num_embeddings, recipe)
    if recipe.is_lora:
        # The adapter's random init must not depend on what ran before (e.g. a CP
        # backend's imports): seed it, so cp=1 and cp=N start from the same weights.
        set_seed(recipe.seed)
        model = apply_lora(model, recipe)
    features = install_memory_features(model, recipe)
    trainable, total = trainable_parameter_count(model)
    log.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, 100 * trainable / max(total, 1))

    resume = resume_checkpoint(recipe)
    if resume is not None and env.rank == 0:
        log.info("resuming from %s", resume)
    with run_scope(recipe, dims):
        trainer = _build_trainer(recipe, dims, env, model, tokenizer, prepared, backend.build, features.loss)
        for callback in [*recipe_callbacks(recipe), *callbacks]:
            trainer.add_callback(callback)
        # The Trainer restores the weights, optimizer, scheduler, RNG states and data position.
        trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
        trainer.save_model(recipe.output_dir)  # the adapter or model, and the tokenizer
        if trainer.is_world_process_zero():
            _write_train_log(Path(recipe.output_dir), trainer.state.log_history)
        history = list(trainer.state.log_history)
        trainer.accelerator.wait_for_everyone()
    return TrainResult(history, Path(recipe.output_dir), time.perf_counter() - started)


@contextlib.contextmanager
def run_scope(recipe: Recipe, dims: ParallelDims) -> Iterator[None]:
    """The run's patches applied, and DeepSpeed's process-wide state put back when the block ends.

    Enter it around everything from building the Trainer on (training or evaluating).
    """
    from cptune.parallel.backends.select import run_patch_set

    on_deepspeed = trains_on_deepspeed(backend_for(recipe, dims.cp_size), recipe)
    with deepspeed_state_restored(on_deepspeed), run_patch_set(recipe).applied(recipe):
        yield


def training_arguments(recipe: Recipe, dims: ParallelDims, env: DistEnv) -> Any:
    """The Trainer's arguments for this recipe and process layout."""
    from transformers import TrainingArguments

    pieces = backend_for(recipe, dims.cp_size).trainer_parallelism(recipe, dims)
    parallelism, deepspeed = pieces.parallelism, pieces.deepspeed
    warmup: float = 0
    if recipe.warmup_steps is not None:
        warmup = recipe.warmup_steps
    elif recipe.warmup_ratio is not None:
        warmup = recipe.warmup_ratio
    eval_steps, save_steps = recipe.resolved_eval_steps, recipe.resolved_save_steps
    on_cpu = not torch.cuda.is_available()
    return TrainingArguments(
        output_dir=recipe.output_dir,
        per_device_train_batch_size=recipe.micro_batch_size,
        per_device_eval_batch_size=recipe.micro_batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        num_train_epochs=recipe.num_epochs,
        max_steps=recipe.max_steps or -1,
        learning_rate=recipe.learning_rate,
        optim=recipe.optimizer,
        optim_args=recipe.resolved_optim_args,
        optim_target_modules=list(recipe.optim_target_modules) if recipe.optim_target_modules else None,
        lr_scheduler_type=recipe.lr_scheduler,
        warmup_steps=warmup,
        weight_decay=recipe.weight_decay,
        max_grad_norm=recipe.max_grad_norm,
        seed=recipe.seed,
        data_seed=recipe.seed,
        bf16=recipe.bf16 is True or (recipe.bf16 == "auto" and torch.cuda.is_available()),
        fp16=recipe.fp16,
        # TF32 exists on NVIDIA GPUs only (the Trainer refuses tf32: true elsewhere).
        tf32=recipe.tf32 if torch.cuda.is_available() else None,
        logging_steps=recipe.logging_steps,
        logging_first_step=True,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        save_total_limit=recipe.save_total_limit,
        eval_strategy="steps" if eval_steps else "no",
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
        disable_tqdm=env.rank != 0,
        # transformers' info level dumps model configs; cptune logs what matters itself.
        log_level="warning",
        log_level_replica="error",
        # The model is the same on every step: no extra autograd traversal per step.
        ddp_find_unused_parameters=False,
        # A collective that waits longer than this fails the run instead of holding it forever.
        ddp_timeout=recipe.ddp_timeout,
        **fsdp_training_arguments(recipe, dims),
    )


def _build_trainer(recipe, dims, env, model, tokenizer, prepared, backend_factory, shard_loss=logits_loss):
    from cptune.data.collator import PackedCollator
    from cptune.run.trainer import CptuneTrainer

    if (
        env.world_size > 1
        and not torch.cuda.is_available()
        and not trains_on_deepspeed(backend_for(recipe, dims.cp_size), recipe)
    ):
        # DeepSpeed's engine (Ulysses, or ring / torch CP under ZeRO) starts its process group itself.
        init_cpu_process_group(recipe.ddp_timeout)
    collator = PackedCollator.for_recipe(recipe, tokenizer.pad_token_id)
    return CptuneTrainer(
        model=model,
        args=training_arguments(recipe, dims, env),
        train_dataset=prepared.train,
        eval_dataset=prepared.eval,
        data_collator=collator,
        processing_class=tokenizer,
        backend_factory=backend_factory,
        cp_size=dims.cp_size,
        tp_size=dims.tp_size,
        shard_loss=shard_loss,
    )


def _write_train_log(output_dir: Path, history: list[dict[str, Any]]) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    write_text(output_dir / TRAIN_LOG_NAME, json.dumps(history, indent=1))


@contextlib.contextmanager
def _restored_environment() -> Iterator[None]:
    """Put ``os.environ`` back as it was (accelerate and transformers set variables while training)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        for name, value in saved.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
