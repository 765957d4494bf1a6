"""The resolved recipe a run keeps in its output_dir, and the check that ``--resume`` continues that run.

A resume restores the weights, the optimizer, the schedule's position and the data position of a
checkpoint, but takes every setting from the recipe and overrides it is given now. Given other
values of a key that shapes the run (steps, schedule, batch, data, parallelism) it would silently
train a different run from the middle of the first. So the run saves its resolved recipe (overrides
included) when it starts, and a resume whose recipe changes such a key is refused before any work,
naming each key with both values.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from cptune.atomic import write_text
from cptune.config.recipe import Recipe
from cptune.errors import CptuneError

log = logging.getLogger("cptune.run_recipe")

RUN_RECIPE_NAME = "run_recipe.yaml"
"""The resolved recipe of the run in output_dir, as ``cptune validate`` prints it."""

RUN_SHAPING_KEYS = (
    # length and schedule
    "max_steps",
    "num_epochs",
    "learning_rate",
    "lr_scheduler",
    "warmup_steps",
    "warmup_ratio",
    "optimizer",
    "optim_args",
    "weight_decay",
    "max_grad_norm",
    # batch
    "micro_batch_size",
    "gradient_accumulation_steps",
    # data and its rows
    "datasets",
    "test_datasets",
    "val_set_size",
    "sequence_len",
    "sample_packing",
    "excess_length_strategy",
    "min_sample_len",
    "train_on_inputs",
    "seed",
    # model and adapter
    "base_model",
    "adapter",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_linear",
    "lora_target_modules",
    "lora_modules_to_save",
    # parallelism
    "context_parallel_size",
    "cp_backend",
    "dp_shard_size",
    "dp_replicate_size",
    "tensor_parallel_size",
)
"""Keys whose value a resumed run must share with the run it continues."""


def _resolved(recipe: Recipe) -> dict[str, Any]:
    # Through YAML and back, so that a saved recipe and a fresh one compare in the same types.
    return yaml.safe_load(_dump(recipe))


def _dump(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def save_run_recipe(recipe: Recipe) -> Path | None:
    """Write the resolved recipe into output_dir when a run starts (rank 0 only).

    A resumed run keeps the file of the run it continues (its shaping keys are checked to be
    the same); one that resumes a run saved without it writes it. Returns the file written, or None.
    """
    path = Path(recipe.output_dir) / RUN_RECIPE_NAME
    if recipe.resume_from_checkpoint not in (None, False) and path.is_file():
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, _dump(recipe))
    return path


# Keys that differ between a run and its resume by the resume's nature.
_RESUME_KEYS = frozenset({"resume_from_checkpoint", "overwrite_output_dir"})


def check_resumed_recipe(recipe: Recipe, checkpoint: Path | None) -> list[str]:
    """Refuse a resume whose recipe changes a key that shapes the run it continues.

    Args:
        recipe: The resumed command's recipe, overrides included.
        checkpoint: The checkpoint it resumes from (None: not resuming); its run is the folder above it.

    Returns:
        The other keys the resume changes (logging, checkpoint and evaluation cadence, ...), one
        ``key: run's value -> value now`` each, for the run to list.

    Raises:
        CptuneError: naming each changed key with the run's value and the value given now.
    """
    if checkpoint is None:
        return []
    saved_path = checkpoint.parent / RUN_RECIPE_NAME
    if not saved_path.is_file():
        log.info(
            "%s saved no %s (an older cptune): its settings cannot be checked",
            checkpoint.parent,
            RUN_RECIPE_NAME,
        )
        return []
    saved = yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {}
    now = _resolved(recipe)
    changed = [key for key in RUN_SHAPING_KEYS if saved.get(key) != now.get(key)]
    if not changed:
        return [
            f"{key}: {_show(saved.get(key))} -> {_show(now.get(key))}"
            for key in sorted(set(saved) | set(now))
            if key not in _RESUME_KEYS and saved.get(key) != now.get(key)
        ]
    lines = [f"  - {key}: {_show(saved.get(key))} in the run, {_show(now.get(key))} now" for key in changed]
    raise CptuneError(
        f"--resume: the recipe and overrides given now change {len(changed)} setting"
        f"{'s' if len(changed) != 1 else ''} of the run in '{checkpoint.parent}', which a resume must keep "
        "(it would continue a different run from the middle of this one):\n"
        + "\n".join(lines)
        + f"\nResume with the run's values (its resolved recipe is {saved_path}: pass the same recipe and "
        "overrides), or start a new run with --overwrite or another output_dir."
    )


def _show(value: Any) -> str:
    return (
        "unset"
        if value is None
        else yaml.safe_dump(value, default_flow_style=True, width=10_000)
        .strip()
        .removesuffix("\n...")
        .strip()
    )
