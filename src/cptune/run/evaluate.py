"""``evaluate(recipe)``: loss and perplexity on the recipe's evaluation data, sharded like training.

Runs in every process of a launch, like :func:`cptune.run.train.train`, with the
same backend, patches and Trainer, so the evaluation of a long sequence is split
across the CP group exactly as its training was, and reports the same
token-weighted loss (:mod:`cptune.run.eval_loop`). The model is the recipe's
base model, or what a run saved: a LoRA adapter (on the base model) or a full
model, in ``output_dir`` or a ``checkpoint-N`` folder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError
from cptune.models.loading import load_model, load_tokenizer
from cptune.models.memory_features import install_memory_features
from cptune.parallel.backends.select import check_model_config, check_prepared_rows, plan_backend
from cptune.parallel.layout import ParallelDims
from cptune.run.checkpoints import (
    CHECKPOINT_MARKER,
    checkpoint_step,
    is_complete_checkpoint,
    latest_complete_checkpoint,
)
from cptune.run.distributed import read_dist_env
from cptune.run.fsdp import is_sharded_checkpoint

log = logging.getLogger("cptune.evaluate")

ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
# What peft saves an adapter's weights as (peft.utils.constants).
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class ModelSource:
    """Which weights to evaluate: the base model, a LoRA adapter on it, or a full model."""

    kind: Literal["base", "adapter", "full"]
    path: Path | None = None

    def describe(self, recipe: Recipe) -> str:
        if self.kind == "base":
            return f"base model {recipe.base_model}"
        if self.kind == "adapter":
            return f"LoRA adapter {self.path} on {recipe.base_model}"
        return f"model {self.path}"


def check_eval_data(recipe: Recipe) -> None:
    """Refuse a recipe without evaluation data (before any process starts or data is prepared)."""
    if not (recipe.val_set_size or recipe.test_datasets):
        raise CptuneError(
            "evaluate: the recipe has no evaluation data; set val_set_size (a held-out share of the "
            "training data) or test_datasets."
        )


def model_source(checkpoint: str | Path | None) -> ModelSource:
    """Where the weights to evaluate (or merge) come from; checked before anything is loaded.

    Args:
        checkpoint: None for the base model, else ``output_dir`` or a ``checkpoint-N`` folder.

    Raises:
        CptuneError: the folder holds no adapter or model, or is a checkpoint whose save did not finish.
    """
    if checkpoint is None:
        return ModelSource("base")
    path = Path(checkpoint)
    if not path.is_dir():
        raise CptuneError(
            f"--checkpoint: '{path}' is not a folder; give output_dir or a checkpoint-N folder of a run."
        )
    if checkpoint_step(path) is not None and not is_complete_checkpoint(path):
        raise CptuneError(
            f"--checkpoint: '{path}' is an incomplete checkpoint (no {CHECKPOINT_MARKER} matching its files: "
            "its save was interrupted). Use another checkpoint."
        )
    if (path / ADAPTER_CONFIG).is_file():
        _check_weights(path, ADAPTER_CONFIG, ADAPTER_WEIGHTS)
        return ModelSource("adapter", path)
    if (path / MODEL_CONFIG).is_file():
        _check_weights(path, MODEL_CONFIG, None)
        return ModelSource("full", path)
    if is_sharded_checkpoint(path):
        raise CptuneError(
            f"--checkpoint: '{path}' is a sharded checkpoint of an FSDP2 run (each process wrote its own part "
            "of the weights), for resuming that run with `cptune train --resume`. Give the run's output_dir "
            "instead: its final model or adapter is gathered into a standard folder."
        )
    latest = latest_complete_checkpoint(path)
    hint = f" It holds checkpoints, e.g. --checkpoint {latest}." if latest is not None else ""
    raise CptuneError(
        f"--checkpoint: '{path}' holds neither a LoRA adapter ({ADAPTER_CONFIG}) nor a model "
        f"({MODEL_CONFIG}).{hint}"
    )


def _check_weights(path: Path, config_name: str, names: tuple[str, ...] | None) -> None:
    """Refuse a folder with a config but no weight files (a copy or save that did not finish)."""
    if names is not None:
        found = any((path / name).is_file() for name in names)
        wanted = " or ".join(names)
    else:
        found = any(p.is_file() and p.suffix in (".safetensors", ".bin") for p in path.iterdir())
        wanted = "*.safetensors or *.bin"
    if not found:
        raise CptuneError(
            f"--checkpoint: '{path}' holds {config_name} but no weights ({wanted}); the save did not finish "
            "or the weight files were not copied. Use a complete folder: the run's output_dir after "
            "training, or a complete checkpoint-N."
        )


def load_source_model(
    recipe: Recipe,
    source: ModelSource,
    attn_implementation: str,
    dims: ParallelDims,
    tokenizer: Any,
    local_rank: int = 0,
) -> Any:
    """The model to evaluate, checked against the CP backend before an adapter wraps it."""
    from cptune.models.tokens import fit_embeddings

    model = load_model(
        recipe,
        attn_implementation,
        path=str(source.path) if source.kind == "full" else None,
        local_rank=local_rank,
    )
    check_model_config(recipe, dims, model.config, type(model))
    if source.kind != "full":
        fit_embeddings(model, tokenizer, recipe.seed)  # the recipe's new tokens, as training grew them
    if source.kind == "adapter":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(source.path), is_trainable=False)
    return model


def evaluate(recipe: Recipe, checkpoint: str | Path | None = None) -> dict[str, float]:
    """Evaluate in this process (one rank of the launch); every rank returns the same metrics.

    Returns:
        ``eval_loss`` (Σ token losses / Σ target tokens over the whole evaluation set),
        ``eval_perplexity``, ``eval_tokens`` and the Trainer's timing metrics.

    Raises:
        CptuneError: the recipe has no evaluation data, or ``checkpoint`` is not usable.
    """
    from cptune.data.prepare import prepare_datasets
    from cptune.run.train import _build_trainer, run_scope

    check_eval_data(recipe)
    source = model_source(checkpoint)
    env = read_dist_env()
    dims = ParallelDims.from_recipe(recipe, env.world_size)
    tokenizer = load_tokenizer(recipe)
    prepared = prepare_datasets(recipe, tokenizer)
    if prepared.eval is None:  # cannot happen after check_eval_data, unless the cache was edited
        raise CptuneError(f"evaluate: the prepared data in {prepared.path} has no evaluation split.")
    check_prepared_rows(recipe, prepared)
    backend = plan_backend(recipe, dims, tokenizer.pad_token_id)
    model = load_source_model(recipe, source, backend.attn_implementation, dims, tokenizer, env.local_rank)
    if env.rank == 0:
        log.info("evaluating %s on %d rows", source.describe(recipe), len(prepared.eval))
    with run_scope(recipe, dims):
        loss = install_memory_features(model, recipe).loss  # tiled MLP and the chunked loss help here too
        trainer = _build_trainer(recipe, dims, env, model, tokenizer, prepared, backend.build, loss)
        metrics = trainer.evaluate()
        trainer.accelerator.wait_for_everyone()
    # The Trainer adds the training epoch to every log; a standalone evaluation has none.
    metrics.pop("epoch", None)
    return metrics
