"""The interface every context-parallel backend implements."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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


@runtime_checkable
class BatchSharder(Protocol):
    """What a backend builds in each process once the accelerator exists: turns a full batch into this rank's inputs.

    Every member is required (each backend defines all of them, even where it takes the
    common answer), so the trainer calls them directly.
    """

    #: the ``attn_implementation`` the model must use with this backend
    attn_implementation: str

    def shard(self, batch: TokenBatch) -> ShardedInputs: ...

    def step_context(self) -> AbstractContextManager:
        """Entered around each micro batch's forward *and* backward (torch CP's dispatch must be on then)."""
        ...

    def wrap_collator(self, collate: Any) -> Any:
        """The collator the backend's data loader needs (the given one for most backends)."""
        ...

    def batch_number(self, micro_index: int, dp_rank: int, dp_size: int) -> int:
        """Which batch of the data loader's order a rank trains as its ``micro_index``-th micro batch."""
        ...


def step_context(backend: BatchSharder) -> AbstractContextManager:
    """The backend's per-step context (kept as a function for the workers and benchmarks that call it)."""
    return backend.step_context()


def batch_number(backend: BatchSharder, micro_index: int, dp_rank: int, dp_size: int) -> int:
    """Which batch of the data loader's order a rank trains as its ``micro_index``-th micro batch."""
    return int(backend.batch_number(micro_index, dp_rank, dp_size))


def accelerate_batch_number(micro_index: int, dp_rank: int, dp_size: int) -> int:
    """accelerate's order: batch ``i`` goes to data-parallel group ``i % dp_size``.

    (``BatchSamplerShard``; the ranks of a CP group share it), so micro batch ``n`` of
    group ``d`` is batch ``n·dp_size + d``.
    """
    return micro_index * dp_size + dp_rank


class SameBatchForEveryCpRank:
    """The members of :class:`BatchSharder` shared by backends that shard the batch themselves.

    Mixed into every sharder: each rank of a CP group gets the same batch from accelerate's loader,
    and the collator is kept.
    """

    def step_context(self) -> AbstractContextManager:
        return nullcontext()

    def wrap_collator(self, collate: Any) -> Any:
        return collate

    def batch_number(self, micro_index: int, dp_rank: int, dp_size: int) -> int:
        return accelerate_batch_number(micro_index, dp_rank, dp_size)
