"""The patch ring-flash-attn 0.1.8 needs around its import with transformers 5.23.

:func:`import_patches` lists it with the flash-attn stand-ins (used when flash-attn is absent,
:func:`cptune.parallel.kernels.flash_attn_shim_patches`); :func:`.sharding.load_ring_flash_attn`
applies them around ``import ring_flash_attn`` only.
"""

from __future__ import annotations

from collections.abc import Sequence

from cptune import versions
from cptune.patches.core import MISSING, Patch


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
        requires=versions.written_for("transformers", "ring-flash-attn"),
        create=True,
    )


def import_patches() -> Sequence[Patch]:
    """The patches applied only around ``import ring_flash_attn`` (each says whether this machine needs it)."""
    from cptune.parallel.kernels import flash_attn_shim_patches

    return (ring_flash_attn_import_compat_patch(), *flash_attn_shim_patches())
