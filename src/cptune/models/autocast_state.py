"""The autocast settings a forward ran under, for code that recomputes it later to run under them again.

The Trainer runs a step's backward outside autocast (accelerate wraps only the model's forward), so
a computation that is redone in the backward -- the tiled MLP's tiles, the chunked loss's chunks --
must enter the forward's autocast itself, or a bf16 run recomputes in another precision than it
computed, and the gradients are not those of the forward. torch's own checkpoint does the same.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AutocastState:
    """Autocast on a device and on the CPU (a CUDA forward may also run inside a CPU autocast)."""

    settings: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def capture(cls, device: torch.device) -> AutocastState:
        """The autocast in force now, for tensors on ``device``."""
        kinds = dict.fromkeys((device.type, "cpu"))
        settings = tuple(
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds
        )
        return cls(settings, torch.is_autocast_cache_enabled())

    def entered(self) -> contextlib.ExitStack:
        """A context manager that runs its body under the captured autocast (on or off)."""
        stack = contextlib.ExitStack()
        for kind, enabled, dtype in self.settings:
            stack.enter_context(
                torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=self.cache_enabled)
            )
        return stack
