"""Inverses of cptune's sequence splits, for tests that put every rank's part back together."""

from __future__ import annotations

import torch


def unshard_contiguous(parts: list[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`cptune.parallel.shard.split_contiguous` given every rank's part in rank order."""
    return torch.cat(parts, dim=dim)


def unshard_zigzag(parts: list[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`cptune.parallel.shard.split_zigzag` given every rank's part in rank order."""
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim=dim)
