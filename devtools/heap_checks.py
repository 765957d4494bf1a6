"""glibc's heap checks for a child process: ``MALLOC_CHECK_`` and ``MALLOC_PERTURB_``, with what makes them work.

``MALLOC_PERTURB_`` belongs to glibc's allocator itself: freed and fresh blocks are filled with a pattern, so
that memory read after it was freed gives garbage instead of the old numbers. ``MALLOC_CHECK_`` does not, since
glibc 2.34: only ``libc_malloc_debug.so`` reads it, and that library must be preloaded. Without it the variable
does nothing (on this project's glibc 2.36 a one-byte overrun of a 20-byte block is freed silently with
``MALLOC_CHECK_=3`` alone, and aborts the process with the library preloaded;
tests/parallel/backends/test_torch_cp_repeat.py).
"""

from __future__ import annotations

import ctypes.util
import os
from collections.abc import Mapping

DEBUG_LIBRARY = "c_malloc_debug"
"""The library that reads ``MALLOC_CHECK_`` since glibc 2.34, as :func:`ctypes.util.find_library` names it."""


def glibc_version() -> tuple[int, int] | None:
    """This machine's glibc as (major, minor); None where the C library is not glibc."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, OSError, ValueError):
        return None
    major, minor, *_ = version.split(".")
    return (int(major), int(minor)) if name == "glibc" else None


def heap_checks(env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """``env`` with glibc checking every ``free`` (``MALLOC_CHECK_=3``) and perturbing freed and fresh memory.

    Returns the environment and why the checks are off (None when they are on): not glibc, or glibc 2.34 or
    later without ``libc_malloc_debug.so``. ``MALLOC_PERTURB_`` is set either way.
    """
    checked = {**env, "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"}
    version = glibc_version()
    if version is None:
        return checked, "the C library is not glibc"
    if version < (2, 34):
        return checked, None
    library = ctypes.util.find_library(DEBUG_LIBRARY)
    if library is None:
        return (
            checked,
            f"glibc {version[0]}.{version[1]} reads MALLOC_CHECK_ only with libc_malloc_debug.so, not found",
        )
    preloaded = [library, *filter(None, checked.get("LD_PRELOAD", "").split())]
    checked["LD_PRELOAD"] = " ".join(preloaded)
    return checked, None
