"""Let ring-flash-attn import cptune's kernels when flash-attn is not installed.

ring-flash-attn 0.1.8 needs exactly four names from flash-attn, all imported at module
level with ``from flash_attn.flash_attn_interface import ...`` (ring_flash_attn.py:3,
zigzag_ring_flash_attn.py:3, stripe_flash_attn.py:3, ring_flash_attn_varlen.py:3-6,
zigzag_ring_flash_attn_varlen.py:2-5, llama3_flash_attn_varlen.py:3-6):
``_flash_attn_forward``, ``_flash_attn_backward``, ``_flash_attn_varlen_forward`` and
``_flash_attn_varlen_backward``. Nothing in ring-flash-attn imports flash-attn later, at call
time, so two ``sys.modules`` entries are needed only while ``ring_flash_attn`` is imported;
its modules keep their own references to the functions afterwards.

The entries are plain module objects with no distribution metadata, no ``__file__`` and no
``__version__``. transformers therefore keeps reporting flash-attn as absent even while they
are installed: ``is_flash_attn_2_available()`` requires a ``flash-attn`` distribution in
``importlib.metadata.packages_distributions()`` (transformers/utils/import_utils.py:1306-1321).
"""

from __future__ import annotations

import importlib.machinery
import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cptune.patches.core import Patch

PACKAGE = "flash_attn"
INTERFACE = "flash_attn.flash_attn_interface"
KERNEL_NAMES = (
    "_flash_attn_forward",
    "_flash_attn_backward",
    "_flash_attn_varlen_forward",
    "_flash_attn_varlen_backward",
)
"""Everything ring-flash-attn 0.1.8 imports from flash-attn (the functions of :mod:`.dispatch`)."""

SHIM_MARKER = "__cptune_shim__"
"""Attribute set on the shim modules, so they are never mistaken for a real flash-attn."""


def flash_attn_available() -> bool:
    """Whether a real flash-attn package is installed (cptune's shim does not count).

    Asks the import machinery without importing anything: a flash-attn that is installed but
    broken (e.g. built for another torch) should fail loudly when ring-flash-attn imports it,
    not be replaced silently by cptune's kernels.
    """
    loaded = sys.modules.get(PACKAGE)
    if loaded is not None and not getattr(loaded, SHIM_MARKER, False):
        return True
    # importlib.util.find_spec would return the shim's spec while the shim is installed, so
    # ask the finders directly (sys.meta_path is what the import statement consults).
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(PACKAGE, None) if find_spec is not None else None
        # A bare `flash_attn` directory on sys.path is a namespace package without an origin.
        if spec is not None and spec.origin is not None:
            return True
    return False


def shim_modules() -> dict[str, ModuleType]:
    """Build fresh ``flash_attn`` and ``flash_attn.flash_attn_interface`` module objects.

    Returns:
        The ``sys.modules`` entries to install while ``ring_flash_attn`` is imported. The
        interface module exposes the four kernels of :mod:`cptune.parallel.kernels.dispatch`
        (PyTorch's FlashAttention-2 on CUDA in bf16/fp16, the pure-PyTorch stand-ins otherwise);
        the package exposes only the interface (not flash-attn's public ``flash_attn_func``
        family, which ring-flash-attn never uses).
    """
    from cptune.parallel.kernels import dispatch

    interface = _module(INTERFACE, is_package=False)
    for name in KERNEL_NAMES:
        setattr(interface, name, getattr(dispatch, name))
    package = _module(PACKAGE, is_package=True)
    # The import system binds a submodule as an attribute of its parent; do the same.
    package.flash_attn_interface = interface
    return {PACKAGE: package, INTERFACE: interface}


def flash_attn_shim_patches() -> list[Patch]:
    """Patches that install :func:`shim_modules` in ``sys.modules`` (created, removed on revert).

    Apply them only when :func:`flash_attn_available` is false, together with the
    transformers compatibility patch, around ``import ring_flash_attn``. An entry already in
    ``sys.modules`` is kept as it is.
    """
    from cptune import versions
    from cptune.patches.core import MISSING, Patch

    modules = shim_modules()
    reason = (
        "ring-flash-attn imports flash-attn's private kernels, and flash-attn is not installed.\n"
        "ring_flash_attn/{ring,zigzag_ring,stripe,ring_flash_attn_varlen,zigzag_ring_flash_attn_varlen,"
        "llama3_flash_attn_varlen}.py import _flash_attn_[varlen_]forward/backward from "
        "flash_attn.flash_attn_interface at module level; cptune's kernels "
        "(cptune.parallel.kernels.dispatch: PyTorch's own FlashAttention-2 on CUDA, pure-PyTorch "
        "stand-ins elsewhere) stand in for them, only during that import."
    )
    return [
        Patch(
            name=f"flash-attn-cpu-shim:{name}",
            target=f"sys:modules[{name!r}]",
            replacement=lambda original, module=module: module if original is MISSING else original,
            reason=reason,
            remove_when="ring-flash-attn runs without flash-attn, or cptune requires flash-attn everywhere.",
            requires={"ring-flash-attn": versions.RING_FLASH_ATTN},
            create=True,
            applies_to=FlashAttnMissing(),
        )
        for name, module in modules.items()
    ]


class FlashAttnMissing:
    """Predicate of the shim patches: flash-attn is not installed (ignores the recipe)."""

    def __call__(self, recipe: object) -> bool:
        return not flash_attn_available()

    def __str__(self) -> str:
        return "flash-attn is not installed (CPU, and GPUs without flash-attn)"


def _module(name: str, *, is_package: bool) -> ModuleType:
    module = ModuleType(name, f"cptune's stand-in for {name} (see cptune.parallel.kernels.shim).")
    # A spec keeps importlib.util.find_spec (used by transformers) from raising on the entry.
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
    module.__package__ = PACKAGE
    if is_package:
        # An empty search path: `import flash_attn.<anything else>` fails as for a missing module.
        module.__path__ = []
    setattr(module, SHIM_MARKER, True)
    return module
