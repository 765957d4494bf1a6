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

    A backend whose training batches are split by the data loader rather than by
    ``shard`` (DeepSpeed's Ulysses adapter) says so with three more attributes,
    read through the helpers below so other backends need not define them:
    ``batch_is_sharded`` (True: each rank's batch is its own slice, so a target is
    counted once across the world, not once per CP rank), ``gradient_divisor``
    (what its engine divides the sum of all ranks' gradients by; DDP divides by the
    world size) and ``wrap_collator(collate) -> collate`` (fits batches to its loader).
    """

    #: the ``attn_implementation`` the model must use with this backend
    attn_implementation: str

    def shard(self, batch: TokenBatch) -> ShardedInputs: ...


def step_context(backend: CpBackend) -> AbstractContextManager:
    """The backend's per-step context, or a null context when it needs none."""
    make = getattr(backend, "step_context", None)
    return make() if make is not None else nullcontext()


def batch_is_sharded(backend: CpBackend) -> bool:
    """True when the data loader already gave this rank its own slice of the batch."""
    return bool(getattr(backend, "batch_is_sharded", False))


def gradient_divisor(backend: CpBackend, world_size: int) -> int:
    """What the sum of all ranks' gradients is divided by: the backend's engine's, else DDP's world size."""
    divisor = getattr(backend, "gradient_divisor", None)
    return world_size if divisor is None else int(divisor)


def wrap_collator(backend: CpBackend, collate: Any) -> Any:
    """The collator the backend's data loader needs (the given one for most backends)."""
    wrap = getattr(backend, "wrap_collator", None)
    return collate if wrap is None else wrap(collate)
