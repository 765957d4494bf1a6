"""Patches of transformers 5.23.

Each function returns one :class:`~cptune.patches.core.Patch`; nothing is
patched until a :class:`~cptune.patches.core.PatchSet` applies it. This module
imports nothing from transformers, so importing it stays cheap and inert.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from cptune import versions
from cptune.patches.core import Patch, Predicate
from cptune.patches.overrides import Override


def _inputs_unchanged(
    self: Any, model: Any, inputs: dict[str, Any]
) -> tuple[Callable[[], contextlib.AbstractContextManager[None]], dict[str, Any]]:
    """Stands in for ``Trainer._prepare_context_parallel_inputs``: no context, inputs as given."""
    return contextlib.nullcontext, inputs


def trainer_cp_inputs_patch(applies_to: Predicate) -> Patch:
    """``Trainer._prepare_context_parallel_inputs`` → return the inputs untouched with a null context.

    The Trainer calls it first thing in ``training_step`` and ``prediction_step``
    (transformers/trainer.py:2068 and :3263). When accelerate's parallelism
    config has ``cp_size > 1`` it builds ``shift_labels`` and ``position_ids``
    and hands the buffers to ``accelerator.maybe_context_parallel``, which
    shards them with torch's ``context_parallel`` (trainer.py:2393-2485). cptune
    pre-shifts labels on the full sequence and shards inputs itself (every backend,
    DeepSpeed's Ulysses included), so this second sharding must not happen.
    """
    return Patch(
        name="trainer-cp-inputs-noop",
        target="transformers.trainer:Trainer._prepare_context_parallel_inputs",
        replacement=lambda original: _inputs_unchanged,
        reason=(
            "cptune shards CP inputs itself; the Trainer must not shard them again.\n"
            "transformers/trainer.py:2393 _prepare_context_parallel_inputs builds shift_labels/position_ids "
            "and routes input buffers through accelerate's torch context_parallel whenever cp_size > 1."
        ),
        remove_when=(
            "transformers lets a Trainer opt out of its CP input path (e.g. a flag or a backend "
            "that shards inputs itself)."
        ),
        requires=versions.written_for("transformers"),
        signature=("self", "model", "inputs"),
        applies_to=applies_to,
    )


TRAINER = "transformers.trainer:Trainer"
TRAINER_OVERRIDES: tuple[Override, ...] = (
    Override(
        name="CptuneTrainer._get_num_items_in_batch",
        target=f"{TRAINER}._get_num_items_in_batch",
        reason=(
            "Counts the step's targets across CP ranks without counting a CP group's shared batch once per rank.\n"
            "transformers/trainer.py:2298 sums the labels of the batches of a step (and gathers them over the "
            "world); cptune's CP ranks hold the same batch, so the sum is divided by the copies."
        ),
        remove_when="the Trainer takes the step's target count from a documented hook.",
        requires=versions.written_for("transformers"),
        signature=("self", "batch_samples", "device"),
    ),
    Override(
        name="CptuneTrainer._get_output_dir",
        target=f"{TRAINER}._get_output_dir",
        reason=(
            "Points the Trainer's checkpoint writing at cptune's staging folder while a checkpoint is written.\n"
            "transformers/trainer.py:3336 gives the folder _save_checkpoint writes under."
        ),
        remove_when="the Trainer writes checkpoints atomically, or takes the checkpoint folder from an argument.",
        requires=versions.written_for("transformers"),
        signature=("self", "trial"),
    ),
    Override(
        name="CptuneTrainer._save_checkpoint",
        target=f"{TRAINER}._save_checkpoint",
        reason=(
            "Writes each checkpoint into a staging folder and publishes it only when complete.\n"
            "transformers/trainer.py:3355 writes the checkpoint folder in place, file by file."
        ),
        remove_when="the Trainer writes checkpoints atomically.",
        requires=versions.written_for("transformers"),
        signature=("self", "model", "trial"),
    ),
    Override(
        name="CptuneTrainer.save_model(_internal_call)",
        target=f"{TRAINER}.save_model",
        reason=(
            "Tells the Trainer's own checkpoint saves (sharded with FSDP2) from the final save (gathered).\n"
            "transformers/trainer.py:4077 passes the private _internal_call=True from its checkpoint code. "
            "Under ZeRO-3 a LoRA adapter (final and in checkpoints) also gets the frozen weights peft saves "
            "with it (trainer.py:4107 gathers only the trainable ones)."
        ),
        remove_when=(
            "the Trainer gathers FSDP2 weights for its final save itself, and hands peft under ZeRO-3 the "
            "frozen weights it saves."
        ),
        requires=versions.written_for("transformers"),
        signature=("self", "output_dir", "_internal_call"),
    ),
    Override(
        name="CptuneTrainer calls Trainer._wrap_model",
        target=f"{TRAINER}._wrap_model",
        reason="cptune's evaluation loop prepares the model as the Trainer's own loop does (trainer.py:2654).",
        remove_when="the Trainer lets a subclass compute the evaluation loss per batch through a public hook.",
        requires=versions.written_for("transformers"),
        signature=("self", "model", "training"),
    ),
    Override(
        name="CptuneTrainer calls Trainer._prepare_inputs",
        target=f"{TRAINER}._prepare_inputs",
        reason="cptune's evaluation loop moves each batch to the device as the Trainer does (trainer.py:2379).",
        remove_when="the Trainer lets a subclass compute the evaluation loss per batch through a public hook.",
        requires=versions.written_for("transformers"),
        signature=("self", "inputs"),
    ),
    Override(
        name="CptuneTrainer calls Trainer._save",
        target=f"{TRAINER}._save",
        reason=(
            "The final save of an FSDP2 model, and a ZeRO-3 LoRA adapter, write the gathered state dict "
            "(trainer.py:4131)."
        ),
        remove_when=(
            "the Trainer gathers FSDP2 weights for its final save itself, and hands peft under ZeRO-3 the "
            "frozen weights it saves."
        ),
        requires=versions.written_for("transformers"),
        signature=("self", "output_dir", "state_dict"),
    ),
    Override(
        name="PreferenceTrainer._prepare_for_training",
        target=f"{TRAINER}._prepare_for_training",
        reason=(
            "Runs precompute_ref_log_probs' first pass on a sharded model (FSDP2, ZeRO-3) once prepared, before a "
            "resumed run's checkpoint is loaded.\n"
            "transformers/trainer.py:1715 prepares the model and loads the checkpoint in one method; the reference "
            "is the model as loaded, so the pass must run between the two."
        ),
        remove_when="the Trainer offers a hook between preparing the model and loading a checkpoint.",
        requires=versions.written_for("transformers"),
        signature=("self", "max_steps", "train_dataloader", "resume_from_checkpoint"),
    ),
    *(
        Override(
            name=f"PreferenceTrainer calls Trainer.{member}",
            target=f"{TRAINER}.{member}",
            reason=(
                "After the first pass on a sharded model, a resumed run's states load as the Trainer's "
                "preparation loads them (trainer.py:1801-1810)."
            ),
            remove_when="the Trainer offers a hook between preparing the model and loading a checkpoint.",
            requires=versions.written_for("transformers"),
            signature=signature,
        )
        for member, signature in (
            ("_load_from_checkpoint", ("self", "resume_from_checkpoint", "model")),
            ("_load_optimizer_and_scheduler", ("self", "checkpoint")),
            ("_load_scaler", ("self", "checkpoint")),
        )
    ),
)
"""The private members of transformers' Trainer that :class:`cptune.run.training.trainer.CptuneTrainer` (and its
:class:`~cptune.run.training.preference_trainer.PreferenceTrainer`) overrides
or calls: checked like patches when the Trainer is built, listed by ``cptune validate`` and on the
patches page."""
