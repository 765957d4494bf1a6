"""The interface every context-parallel backend implements."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cptune.parallel.backends.attention import AttentionCall
from cptune.parallel.shard import TokenBatch, TokenCoords


@dataclass(frozen=True)
class ShardedInputs:
    """What one rank feeds the model for one micro batch, the targets of its tokens and where they sit.

    ``coords`` places each of the rank's tokens in the full batch (exact dropout keys its
    masks on them); None only from a backend that cannot say, which exact dropout refuses.
    """

    model_kwargs: dict[str, Any]
    shift_labels: torch.Tensor
    call: AttentionCall | None
    coords: TokenCoords | None = None


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
    world size), ``wrap_collator(collate) -> collate`` (fits batches to its loader)
    and ``batch_number`` (the order its loader gives batches in; see :func:`batch_number`).
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


def batch_number(backend: CpBackend, micro_index: int, dp_rank: int, dp_size: int) -> int:
    """Which batch of the data loader's order a rank trains as its ``micro_index``-th micro batch.

    accelerate's loader hands batch ``i`` to data-parallel group ``i % dp_size``
    (``BatchSamplerShard``; the ranks of a CP group share it), so micro batch ``n`` of
    group ``d`` is batch ``n·dp_size + d``; a backend whose loader orders batches
    otherwise defines ``batch_number`` itself (DeepSpeed's Ulysses adapter).
    """
    own = getattr(backend, "batch_number", None)
    return micro_index * dp_size + dp_rank if own is None else int(own(micro_index, dp_rank, dp_size))


def wrap_collator(backend: CpBackend, collate: Any) -> Any:
    """The collator the backend's data loader needs (the given one for most backends)."""
    wrap = getattr(backend, "wrap_collator", None)
    return collate if wrap is None else wrap(collate)
