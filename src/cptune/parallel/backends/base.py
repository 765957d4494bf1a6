"""The interface every context-parallel backend implements."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cptune.parallel.backends.attention import AttentionCall
from cptune.parallel.shard import TokenBatch


@dataclass(frozen=True)
class ShardedInputs:
    """What one rank feeds the model for one micro batch, and the targets of its tokens."""

    model_kwargs: dict[str, Any]
    shift_labels: torch.Tensor
    call: AttentionCall | None


class CpBackend(Protocol):
    """Turns a full batch into this rank's model inputs.

    A backend may also define ``step_context() -> ContextManager``: the trainer
    enters it around each micro batch's forward *and* backward (e.g. torch's
    context-parallel dispatch must be active while autograd runs the backward).
    """

    #: the ``attn_implementation`` the model must use with this backend
    attn_implementation: str

    def shard(self, batch: TokenBatch) -> ShardedInputs: ...


def step_context(backend: CpBackend) -> AbstractContextManager:
    """The backend's per-step context, or a null context when it needs none."""
    make = getattr(backend, "step_context", None)
    return make() if make is not None else nullcontext()
