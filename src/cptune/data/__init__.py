"""Data: sources, row formats, packing, collation and the preprocess cache.

The names below are importable from ``cptune.data`` but load their module on
first use, so that importing the package imports neither torch nor datasets.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PackedCollator": "cptune.data.collator",
    "first_fit_decreasing": "cptune.data.packing",
    "pack_samples": "cptune.data.packing",
    "PreparedData": "cptune.data.prepare",
    "prepare_datasets": "cptune.data.prepare",
    "load_prepared": "cptune.data.prepare",
    "PrepStats": "cptune.data.stats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
