"""The patches of accelerate 1.15 and transformers 5.23 that only ``cp_backend: deepspeed`` (Ulysses) needs.

:func:`ulysses_patches` lists them, in the order they are applied, with the predicate the backend
passes (:meth:`.runtime.DeepSpeedUlyssesRuntime.training_patches`); the patches of DeepSpeed's
engine that every run on it needs are :func:`cptune.patches.deepspeed_patches.deepspeed_engine_patches`.
Nothing is imported or patched until a :class:`~cptune.patches.core.PatchSet` applies them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from cptune import versions
from cptune.patches.core import Patch, Predicate

DEEPSPEED_REQUIREMENT = {"deepspeed": versions.DEEPSPEED}
ACCELERATE_REQUIREMENT = {"accelerate": versions.ACCELERATE}
TRANSFORMERS_REQUIREMENT = {"transformers": versions.TRANSFORMERS}


def sp_attn_allows_cptune_patch(applies_to: Predicate, document_attention: str) -> Patch:
    """``DeepSpeedSequenceParallelConfig.__post_init__`` → also accept cptune's core attention.

    accelerate/utils/dataclasses.py:2292-2309 accepts only ``flash_attention_2/3``,
    ``sdpa`` and hub flash-attn kernels, although DeepSpeed itself takes any name
    registered in transformers' ``AttentionInterface`` (ulysses_sp.py:488-492).
    cptune's document-aware attention (the only core attention that keeps packed
    documents apart on CPU) is registered under its own name; the wrapper
    validates it as ``sdpa`` would be and then puts the name back.
    """

    def replacement(original: Callable[[Any], None]) -> Callable[[Any], None]:
        @functools.wraps(original)
        def __post_init__(self: Any) -> None:
            name = self.sp_attn_implementation
            if name != document_attention:
                return original(self)
            self.sp_attn_implementation = "sdpa"
            try:
                original(self)
            finally:
                self.sp_attn_implementation = name

        return __post_init__

    return Patch(
        name="accelerate-sp-attn-allow-cptune",
        target="accelerate.utils.dataclasses:DeepSpeedSequenceParallelConfig.__post_init__",
        replacement=replacement,
        reason=(
            "Lets DeepSpeed's Ulysses wrap cptune's document-aware attention.\n"
            "accelerate/utils/dataclasses.py:2303 rejects attention names other than flash_attention_2/3, sdpa "
            "and hub kernels; DeepSpeed's register_with_transformers accepts any registered name."
        ),
        remove_when="accelerate accepts any attention registered in transformers' AttentionInterface.",
        requires=ACCELERATE_REQUIREMENT,
        signature=("self",),
        applies_to=applies_to,
    )


def attention_registry_scope_patch(applies_to: Predicate) -> Patch:
    """``ALL_ATTENTION_FUNCTIONS._local_mapping`` → a copy for the run, so DeepSpeed's wrapper goes away after.

    ``UlyssesSPAttentionHF.register_with_transformers`` installs its all-to-all
    wrapper with ``ALL_ATTENTION_FUNCTIONS[core] = uattn_wrapper``
    (ulysses_sp.py:566), which lands in the instance's ``_local_mapping``
    (transformers/utils/generic.py:1129-1131) and is never taken out: after the
    run, every model in the process would still route ``sdpa`` (or cptune's
    attention) through a wrapper holding the finished run's process group, and a
    second run would wrap the wrapper. The patch gives the registry a copy of its
    local mapping for the run; reverting puts the original dict back, without
    DeepSpeed's entry. Models read the registry through the same object, so they
    see the wrapper while the run lasts.
    """
    return Patch(
        name="attention-registry-run-scope",
        target="transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS._local_mapping",
        replacement=lambda original: dict(original),
        reason=(
            "Keeps DeepSpeed's Ulysses attention wrapper from outliving the run.\n"
            "deepspeed ulysses_sp.py:566 writes it into ALL_ATTENTION_FUNCTIONS (its _local_mapping, "
            "transformers/utils/generic.py:1131) for good."
        ),
        remove_when="DeepSpeed undoes its attention registration (or registers under a name of its own).",
        requires={**TRANSFORMERS_REQUIREMENT, **DEEPSPEED_REQUIREMENT},
        applies_to=applies_to,
    )


def ulysses_patches(applies_to: Predicate, document_attention: str) -> list[Patch]:
    """The patches only cp_backend: deepspeed (Ulysses) needs, in the order they are applied.

    Args:
        applies_to: When they apply (the backend passes ``cp_backend: deepspeed`` at cp > 1).
        document_attention: The name cptune's document-aware attention is registered under.
    """
    return [
        sp_attn_allows_cptune_patch(applies_to, document_attention),
        attention_registry_scope_patch(applies_to),
    ]
