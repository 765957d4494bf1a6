"""DeepSpeed's process-wide state, put back when a run on DeepSpeed's engine ends.

A run on DeepSpeed's engine leaves state behind in module globals of DeepSpeed and transformers,
which would reach into the next run of the same process (``cptune.run.training.train.train`` called twice,
e.g. from a notebook):

* transformers' weak reference to the run's DeepSpeed config (``set_hf_deepspeed_config``,
  transformers/integrations/deepspeed.py:270-275). accelerate's ``DeepSpeedPlugin`` in its shared
  ``AcceleratorState`` keeps the config alive, so ``is_deepspeed_zero3_enabled()`` stays true after a
  ZeRO-3 run, and the next run loads its model partitioned under ``zero.Init`` whatever its recipe
  says (measured: a ring-flash-attn run after a ZeRO-3 run stopped in its first forward).
* DeepSpeed's registry of all-to-all groups (deepspeed/sequence/layer.py:316-323), to which every
  ``UlyssesSPAttentionHF`` adds its process group: it would keep the finished run's CP group.
* DeepSpeed's model-parallel unit and sequence-parallel groups (``deepspeed.utils.groups.mpu``,
  engine.py:2121-2122; ``parallel_state_sp``), which a Ulysses setup through accelerate's
  ``sp_backend="deepspeed"`` set for good, so that a second Ulysses run stopped at "sequence parallel
  group is already initialized" and ring / torch CP under ZeRO divided the gradient by the finished
  run's data-parallel size. cptune no longer creates them (its Ulysses runs on the mesh's CP group,
  :mod:`cptune.parallel.backends.deepspeed_ulysses.sharding`); they are put back all the same.

Objects of the run itself (the Trainer, its accelerator) are left as they are; accelerate's shared
state is reset by the next run's ``TrainingArguments``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

_MISSING = object()

GLOBALS: tuple[tuple[str, str], ...] = (
    ("transformers.integrations.deepspeed", "_hf_deepspeed_config_weak_ref"),
    ("deepspeed.utils.groups", "mpu"),
    ("deepspeed.runtime.sequence_parallel.parallel_state_sp", "_SEQUENCE_PARALLEL_GROUP"),
    ("deepspeed.runtime.sequence_parallel.parallel_state_sp", "_SEQUENCE_DATA_PARALLEL_GROUP"),
)
"""Module globals a run may rebind: (module, name); put back to the object they held before the run."""

REGISTRIES: tuple[tuple[str, str], ...] = (("deepspeed.sequence.layer", "_all_to_all_groups"),)
"""Module-level dicts a run adds to: (module, name); put back to the entries they held before the run."""


def snapshot() -> dict[tuple[str, str], Any]:
    """The objects in :data:`GLOBALS` and copies of the dicts in :data:`REGISTRIES` (imports their modules)."""
    state: dict[tuple[str, str], Any] = {}
    for module, name in GLOBALS:
        state[(module, name)] = getattr(importlib.import_module(module), name, _MISSING)
    for module, name in REGISTRIES:
        registry = getattr(importlib.import_module(module), name, _MISSING)
        state[(module, name)] = dict(registry) if isinstance(registry, dict) else _MISSING
    return state


def restore(state: dict[tuple[str, str], Any]) -> None:
    """Put back what :func:`snapshot` saw."""
    for (module_name, name), value in state.items():
        module = importlib.import_module(module_name)
        if value is _MISSING:
            continue  # this DeepSpeed has no such global
        if (module_name, name) in REGISTRIES:
            registry = getattr(module, name)
            registry.clear()
            registry.update(value)
        else:
            setattr(module, name, value)


@contextlib.contextmanager
def deepspeed_state_restored(on_deepspeed: bool) -> Iterator[None]:
    """Put DeepSpeed's process-wide state back as it was when the block ends (also when it raises).

    Args:
        on_deepspeed: Whether the run trains on DeepSpeed's engine; other runs touch none of it,
            and DeepSpeed is not imported for them.
    """
    if not on_deepspeed:
        yield
        return
    state = snapshot()
    try:
        yield
    finally:
        restore(state)
