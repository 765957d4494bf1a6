"""Process layout: world = dp × cp, as pure arithmetic.

Vocabulary: an *axis* is a mesh axis (``dp``, ``cp``); a *dim* is a tensor
dimension. Ranks are laid out with cp innermost, ``rank = dp_rank * cp + cp_rank``,
the same order accelerate's device mesh uses (``dp_replicate`` before ``cp``), so the
ranks of one CP group are consecutive and share a data-loader shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from cptune.errors import LaunchError


@dataclass(frozen=True)
class ParallelDims:
    """How ``world_size`` processes split into data-parallel and context-parallel axes."""

    world_size: int
    cp_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.cp_size < 1:
            raise LaunchError(f"world size ({self.world_size}) and context_parallel_size must be positive.")
        if self.world_size % self.cp_size != 0:
            raise LaunchError(
                f"context_parallel_size={self.cp_size} does not divide the number of processes "
                f"({self.world_size}). Launch a multiple of {self.cp_size} processes "
                f"(e.g. --nproc-per-node {self.cp_size}), or change context_parallel_size."
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    def cp_rank(self, rank: int) -> int:
        return rank % self.cp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.cp_size

    def cp_group_ranks(self, dp_rank: int) -> list[int]:
        """The global ranks that split one sequence together."""
        start = dp_rank * self.cp_size
        return list(range(start, start + self.cp_size))
