"""Which weights a command runs (the base model, a trained LoRA adapter on it, or a full model) and loading them.

``cptune evaluate``, ``cptune inference`` and ``cptune merge-lora`` read ``--checkpoint`` (``output_dir``
or a ``checkpoint-N`` folder) through :func:`model_source`, which refuses what cannot be loaded before
anything is; :func:`load_source_model` loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError
from cptune.models.loading import load_model
from cptune.run.training.checkpoints import (
    CHECKPOINT_MARKER,
    checkpoint_step,
    is_complete_checkpoint,
    latest_complete_checkpoint,
)
from cptune.run.training.fsdp import is_sharded_checkpoint

ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
# What peft saves an adapter's weights as (peft.utils.constants).
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class ModelSource:
    """Which weights to run: the base model, a LoRA adapter on it, or a full model."""

    kind: Literal["base", "adapter", "full"]
    path: Path | None = None

    def describe(self, recipe: Recipe) -> str:
        if self.kind == "base":
            return f"base model {recipe.base_model}"
        if self.kind == "adapter":
            return f"LoRA adapter {self.path} on {recipe.base_model}"
        return f"model {self.path}"


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
    attn_implementation: str | None,
    tokenizer: Any,
    *,
    check_model: Callable[[Any, type], None] | None = None,
    local_rank: int = 0,
) -> Any:
    """The model a command runs: the base model, a LoRA adapter on it, or a full model (``source``).

    Shared by ``cptune evaluate``, ``cptune inference`` and what they share with training: the
    recipe's dtype and quantization (:func:`~cptune.models.loading.load_model`), the embeddings grown
    as training grew them (for the recipe's new tokens, to a multiple of 32 with
    ``resize_token_embeddings_to_32x``; the adapter then carries their trained rows),
    and the adapter on top.

    Args:
        check_model: Called with the model's config and class before an adapter wraps it (the run
            plan's backend checks, for a model sharded like training).
    """
    from cptune.models.added_tokens import fit_embeddings

    model = load_model(
        recipe,
        attn_implementation,
        path=str(source.path) if source.kind == "full" else None,
        local_rank=local_rank,
    )
    if check_model is not None:
        check_model(model.config, type(model))
    if source.kind != "full":
        # As training grew them: the recipe's new tokens, resize_token_embeddings_to_32x.
        fit_embeddings(model, tokenizer, recipe)
    if source.kind == "adapter":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(source.path), is_trainable=False)
    return model
