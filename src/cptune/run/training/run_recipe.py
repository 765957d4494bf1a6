"""The resolved recipe a run keeps in its output_dir, and how ``--resume`` continues that same run.

A resume restores the weights, the optimizer, the schedule's position and the data position of a
checkpoint; its settings must be the run's too. Given other values of a key that shapes the run
(steps, schedule, batch, data, parallelism) it would silently train a different run from the middle
of the first. So the run saves its resolved recipe when it starts, with the command-line overrides
it was started with, and a resume:

- trains with the recipe file it is given, the run's own overrides, then the overrides given now
  (:func:`resumed_recipe`): ``cptune train recipe.yaml --resume`` needs no overrides repeated;
- is refused before any work when that recipe changes a key that shapes the run, naming each key
  with both values (:func:`check_resumed_recipe`); other changes (logging, checkpoint and
  evaluation cadence) are applied and listed.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from cptune.atomic import write_text
from cptune.config.loader import parse_override, read_recipe_file, set_by_path, validate_recipe
from cptune.config.recipe import Recipe
from cptune.errors import CptuneError, RecipeError
from cptune.run.training.checkpoints import resume_checkpoint

log = logging.getLogger("cptune.run_recipe")

RUN_RECIPE_NAME = "run_recipe.yaml"
"""The resolved recipe of the run in output_dir, as ``cptune validate`` prints it.

Its first lines are comments; one of them, ``# overrides: ...``, holds the command-line overrides
the run was started with (shell-quoted), which a resume applies again.
"""

_OVERRIDES_LINE = "# overrides:"

RUN_SHAPING_KEYS = (
    # length and schedule
    "max_steps",
    "num_epochs",
    "learning_rate",
    "lr_scheduler",
    "cosine_min_lr_ratio",
    "warmup_steps",
    "warmup_ratio",
    "optimizer",
    "optim_args",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
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
    "unfrozen_parameters",  # what trains: the checkpoint's optimizer state holds those parameters only
    "resize_token_embeddings_to_32x",
    "tokens",  # new tokens grow the embeddings, and their ids are in the data
    "special_tokens",
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


def save_run_recipe(recipe: Recipe, overrides: Sequence[str] = ()) -> Path | None:
    """Write the resolved recipe and the run's overrides into output_dir when a run starts (rank 0 only).

    A resumed run keeps the file of the run it continues (its shaping keys are checked to be
    the same); one that resumes a run saved without it writes it.

    Args:
        recipe: The run's recipe, overrides included.
        overrides: The command-line overrides it was started with (``--key=value``), which a
            resume applies again.

    Returns:
        The file written, or None.
    """
    path = Path(recipe.output_dir) / RUN_RECIPE_NAME
    if recipe.resume_from_checkpoint not in (None, False) and path.is_file():
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# The resolved recipe of the run in this folder; `cptune train RECIPE --resume` continues it\n"
        "# with the overrides it was started with (below) and refuses changes to how the run is shaped.\n"
        f"{_OVERRIDES_LINE} {shlex.join(overrides)}".rstrip()
        + "\n"
    )
    write_text(path, header + _dump(recipe))
    return path


def saved_overrides(run_dir: Path) -> list[str]:
    """The overrides the run in ``run_dir`` was started with (none when it saved none, or no recipe)."""
    path = run_dir / RUN_RECIPE_NAME
    if not path.is_file():
        return []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if line.startswith(_OVERRIDES_LINE):
            return shlex.split(line.removeprefix(_OVERRIDES_LINE))
    return []


# Keys that differ between a run and its resume by the resume's nature.
_RESUME_KEYS = frozenset({"resume_from_checkpoint", "overwrite_output_dir"})
# Keys of the run's overrides a resume does not apply again: the resume's own keys, and output_dir
# (the run is where the resume found it, also when its folder was moved).
_NOT_REAPPLIED = _RESUME_KEYS | {"output_dir"}


def resumed_recipe(recipe: Recipe, source: str | Path, overrides: Sequence[str]) -> tuple[Recipe, list[str]]:
    """The recipe a resume trains with: the run's own overrides applied again under the ones given now.

    ``recipe`` is the command's recipe file with the overrides given now; when it resumes a run
    that saved its overrides, the result is the same file with the run's overrides and then the
    ones given now (a key given both ways takes the value given now), so a resume without
    overrides continues the run it resumes. :func:`check_resumed_recipe` then refuses whatever
    still changes how that run is shaped.

    Args:
        recipe: The command's recipe, overrides and ``--resume`` / ``--overwrite`` included.
        source: The recipe file it was read from.
        overrides: The overrides given now (``--key=value``).

    Returns:
        The recipe to train with, and the run's overrides that were applied again (empty when
        not resuming, or when the run saved none).

    Raises:
        CptuneError: there is no checkpoint to resume from, or the run's overrides do not fit the
            recipe file given now.
    """
    checkpoint = resume_checkpoint(recipe)
    if checkpoint is None:
        return recipe, []
    run_dir = checkpoint.parent
    reapplied = [o for o in saved_overrides(run_dir) if _top_key(o) not in _NOT_REAPPLIED]
    if not reapplied:
        return recipe, []
    data = read_recipe_file(source)
    try:
        for override in reapplied:
            set_by_path(data, *parse_override(override))
    except RecipeError as err:
        raise RecipeError(
            err.problems,
            source=f"{source} with the overrides of the run in {run_dir}, {shlex.join(reapplied)}",
        ) from None
    for override in overrides:
        set_by_path(data, *parse_override(override))
    data["resume_from_checkpoint"] = recipe.resume_from_checkpoint
    data["overwrite_output_dir"] = recipe.overwrite_output_dir
    return validate_recipe(data, source=str(source)), reapplied


def _top_key(override: str) -> str:
    return parse_override(override)[0].split(".")[0]


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
    started_with = saved_overrides(checkpoint.parent)
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
        + f"\nA resume applies the overrides the run was started with ({shlex.join(started_with) or 'none'}) "
        f"itself; drop the overrides that change these keys, or restore the recipe file's values (the "
        f"run's resolved recipe is {saved_path}). To train with the new values, start a new run with "
        "--overwrite or another output_dir."
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
