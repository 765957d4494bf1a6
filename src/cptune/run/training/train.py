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

from cptune.atomic import write_text
from cptune.config.recipe import Recipe
from cptune.models.freezing import apply_unfrozen_parameters
from cptune.models.loading import (
    apply_lora,
    check_token_ids,
    load_model,
    load_tokenizer,
    trainable_parameter_count,
)
from cptune.models.memory_features import install_memory_features
from cptune.run.plan import RunPlan
from cptune.run.training.builder import build_trainer, run_scope
from cptune.run.training.checkpoints import resume_checkpoint
from cptune.run.training.distributed import read_dist_env
from cptune.run.training.output_dir import (
    TRAIN_LOG_NAME,
    check_earlier_run,
    check_output_dir,
    clear_earlier_run,
)
from cptune.run.training.run_recipe import check_resumed_recipe, save_run_recipe

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


def train(
    recipe: Recipe,
    callbacks: Sequence[Any] = (),
    *,
    plan: RunPlan | None = None,
    data_reported: bool = False,
    overrides: Sequence[str] = (),
) -> TrainResult:
    """Fine-tune as the recipe says, in this process (one rank of the launch).

    Environment variables that the libraries set while training (accelerate's
    and transformers' own settings) and DeepSpeed's process-wide state are restored
    when this returns or raises, as the patches are: a second run in the same process
    starts from the same state.

    Args:
        recipe: The validated recipe.
        callbacks: ``transformers.TrainerCallback`` objects added to the Trainer (e.g. to
            measure steps); they see the model as trained (wrapped, and sharded with FSDP2).
        plan: This process's plan of ``recipe`` when the caller has built it (a one-process run
            after the launcher's preflight); by default it is built here for the launch's processes.
        data_reported: The launcher's preflight prepared the data (or found it cached) and said
            which; rank 0 then does not report it again as loaded from the cache it just wrote.
        overrides: The command-line overrides ``recipe`` was read with (``--key=value``); a run
            saves them with its resolved recipe, and a resume applies them again.
    """
    with _restored_environment():
        return _train(recipe, callbacks, plan, data_reported, overrides)


def _train(
    recipe: Recipe,
    callbacks: Sequence[Any],
    plan: RunPlan | None,
    data_reported: bool,
    overrides: Sequence[str],
) -> TrainResult:
    from transformers import set_seed

    from cptune.config.axolotl.notes import axolotl_notes
    from cptune.data.prepare import prepare_datasets
    from cptune.models.added_tokens import fit_embeddings
    from cptune.run.training.tracking import recipe_callbacks, tracker_environment

    env = read_dist_env()
    plan = plan or RunPlan.build(recipe, env.world_size)
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
    changed = check_resumed_recipe(recipe, resume_checkpoint(recipe))
    # The model's config against the backend and the layout (the preflight's model checks, router jitter and
    # padding seen by a router loss among them), before anything is written, prepared or loaded.
    plan.check_model_before_loading()
    if env.rank == 0:
        if changed:
            log.info("the resume changes settings that do not shape the run: %s", "; ".join(changed))
        clear_earlier_run(recipe)
        save_run_recipe(recipe, overrides)

    tokenizer = load_tokenizer(recipe)
    prepared = prepare_datasets(recipe, tokenizer)
    plan.check_prepared_rows(prepared)
    if env.rank == 0 and not data_reported:
        log.info("%s", prepared.stats.format())

    if recipe.is_fsdp and not plan.dims.sharded:
        log.info("fsdp_version: 2 with one process: there is nothing to shard; training without FSDP")
    attention = plan.attention(tokenizer.pad_token_id)
    if recipe.offloads_activations:  # under torchrun no preflight ran: check before loading
        from cptune.models.loading import model_config
        from cptune.run.memory_plan import check_host_memory

        check_host_memory(recipe, model_config(recipe), env.local_world_size)
    model = load_model(recipe, attention.attn_implementation, local_rank=env.local_rank)
    plan.check_model(model.config, type(model))
    # Before the embeddings grow: only the recipe's own tokens may lie beyond the base model's rows.
    check_token_ids(prepared, tokenizer, model.get_input_embeddings().num_embeddings, recipe)
    fit_embeddings(model, tokenizer, recipe)
    if recipe.is_lora:
        # The adapter's random init must not depend on what ran before (e.g. a CP
        # backend's imports): seed it, so cp=1 and cp=N start from the same weights.
        set_seed(recipe.seed)
        model = apply_lora(model, recipe)
    # Before the memory features and the Trainer's wrapping (DDP, FSDP2, DeepSpeed) see the parameters.
    apply_unfrozen_parameters(model, recipe)
    features = install_memory_features(model, recipe)
    trainable, total = trainable_parameter_count(model)
    log.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, 100 * trainable / max(total, 1))

    resume = resume_checkpoint(recipe)
    if resume is not None and env.rank == 0:
        log.info("resuming from %s", resume)
    with run_scope(plan):
        trainer = build_trainer(plan, env, model, tokenizer, prepared, attention.build, features.loss)
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
