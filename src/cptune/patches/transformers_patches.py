"""Patches of transformers 5.23.

Each function returns one :class:`~cptune.patches.core.Patch`; nothing is
patched until a :class:`~cptune.patches.core.PatchSet` applies it. This module
imports nothing from transformers, so importing it stays cheap and inert.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from cptune.patches.core import MISSING, Patch, Predicate

TRANSFORMERS_REQUIREMENT = {"transformers": ">=5.23,<5.24"}
"""The transformers versions these patches were read against."""


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
    pre-shifts labels on the full sequence and shards inputs itself, so this
    second sharding must not happen. Deepspeed keeps the original: there
    accelerate's own Ulysses data-loader adapter shards, and the Trainer path is
    what transformers and deepspeed expect.
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
        requires=TRANSFORMERS_REQUIREMENT,
        signature=("self", "model", "inputs"),
        applies_to=applies_to,
    )


def ring_flash_attn_import_compat_patch() -> Patch:
    """Provides ``is_flash_attn_greater_or_equal_2_10`` while ``ring_flash_attn`` is imported.

    ring-flash-attn 0.1.8 does ``from transformers.modeling_flash_attention_utils
    import is_flash_attn_greater_or_equal_2_10`` (ring_flash_attn/adapters/hf_adapter.py:9-17)
    and later only tests its truth (``if is_flash_attn_greater_or_equal_2_10:``,
    hf_adapter.py:129), to decide whether flash-attn takes ``deterministic``.
    transformers 5.x removed the name from that module, so the import fails.
    The patch creates it as ``True`` (every flash-attn 2.8 build, and cptune's
    CPU stand-in, takes ``deterministic``); an existing value is kept. It is
    needed only around the import: ``from ... import`` copies the value into
    ring_flash_attn's namespace, so reverting right after is safe.

    Use it as ``with PatchSet([ring_flash_attn_import_compat_patch()]).applied(): import ring_flash_attn``.
    """
    return Patch(
        name="ring-flash-attn-import-compat",
        target="transformers.modeling_flash_attention_utils:is_flash_attn_greater_or_equal_2_10",
        replacement=lambda original: True if original is MISSING else original,
        reason=(
            "ring-flash-attn 0.1.8 imports a flag that transformers 5.x removed.\n"
            "ring_flash_attn/adapters/hf_adapter.py:9-17 imports is_flash_attn_greater_or_equal_2_10 from "
            "transformers.modeling_flash_attention_utils and uses it as a bool at hf_adapter.py:129."
        ),
        remove_when="ring-flash-attn stops importing is_flash_attn_greater_or_equal_2_10 (after 0.1.8).",
        requires={**TRANSFORMERS_REQUIREMENT, "ring-flash-attn": "==0.1.8"},
        create=True,
    )
