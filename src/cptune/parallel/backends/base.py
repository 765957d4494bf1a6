"""The interface every context-parallel backend implements."""

from __future__ import annotations

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
    """Turns a full batch into this rank's model inputs."""

    #: the ``attn_implementation`` the model must use with this backend
    attn_implementation: str

    def shard(self, batch: TokenBatch) -> ShardedInputs: ...
