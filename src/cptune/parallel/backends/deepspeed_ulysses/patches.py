"""The patch of transformers 5.23 (with DeepSpeed 0.19's Ulysses) that only ``cp_backend: deepspeed`` needs.

:func:`ulysses_patches` lists it with the predicate the backend passes
(:meth:`.runtime.DeepSpeedUlyssesRuntime.training_patches`); the patches of DeepSpeed's engine that
every run on it needs are :func:`cptune.patches.deepspeed_patches.deepspeed_engine_patches`. Nothing
is imported or patched until a :class:`~cptune.patches.core.PatchSet` applies it.
"""

from __future__ import annotations

from cptune import versions
from cptune.patches.core import Patch, Predicate


def attention_registry_scope_patch(applies_to: Predicate) -> Patch:
    """``ALL_ATTENTION_FUNCTIONS._local_mapping`` → a copy for the run, so the Ulysses wrapper goes away after.

    :func:`~cptune.parallel.backends.deepspeed_ulysses.sharding.install_ulysses_attention` puts
    DeepSpeed's all-to-all wrapper in place of the core attention with
    ``ALL_ATTENTION_FUNCTIONS[core] = wrapper``, as DeepSpeed's own ``register_with_transformers``
    does (ulysses_sp.py:566): transformers keeps the special cases of that name. The assignment lands
    in the instance's ``_local_mapping`` (transformers/utils/generic.py:1129-1131) and stays there:
    after the run, every model in the process would still route ``sdpa`` (or cptune's attention)
    through a wrapper holding the finished run's process group, and a second run would wrap the
    wrapper. The patch gives the registry a copy of its local mapping for the run; reverting puts
    the original dict back, without the wrapper. Models read the registry through the same object,
    so they see the wrapper while the run lasts.
    """
    return Patch(
        name="attention-registry-run-scope",
        target="transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS._local_mapping",
        replacement=lambda original: dict(original),
        reason=(
            "Keeps DeepSpeed's Ulysses attention wrapper from outliving the run.\n"
            "It is registered under the core attention's own name, as deepspeed ulysses_sp.py:566 does, into "
            "ALL_ATTENTION_FUNCTIONS (its _local_mapping, transformers/utils/generic.py:1131) for good."
        ),
        remove_when="transformers lets a registration be scoped or undone (or DeepSpeed's wrapper gets a name of its own).",
        requires=versions.written_for("transformers", "deepspeed"),
        applies_to=applies_to,
    )


def ulysses_patches(applies_to: Predicate) -> list[Patch]:
    """The patches only cp_backend: deepspeed (Ulysses) needs, in the order they are applied.

    Args:
        applies_to: When they apply (the backend passes ``cp_backend: deepspeed`` at cp > 1).
    """
    return [attention_registry_scope_patch(applies_to)]
