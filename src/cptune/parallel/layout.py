"""Process layout: world = dp_replicate × dp_shard × cp × tp, as pure arithmetic.

Vocabulary: an *axis* is a mesh axis (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``);
a *dim* is a tensor dimension. Ranks are laid out with tp innermost, then cp,
``rank = ((replica * dp_shard + shard) * cp + cp_rank) * tp + tp_rank``, the order
accelerate's device mesh uses, so the ranks of one CP × TP group are consecutive
and share a data-loader shard. Without FSDP there is one data-parallel axis
(``dp_size`` groups of ``cp_size`` ranks); with FSDP2 the model states are
sharded over the ``dp_shard × cp`` ranks of a replica and replicated across
``dp_replicate`` replicas (HSDP). Tensor parallelism (FSDP2 only) splits each
weight over the ``tp`` ranks first; FSDP2 shards those pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cptune.errors import LaunchError

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe


@dataclass(frozen=True)
class ParallelDims:
    """How ``world_size`` processes split into data-parallel and context-parallel axes.

    Attributes:
        world_size: Processes of the run.
        cp_size: Ranks that split one sequence.
        dp_replicate_size: Replicas of the sharded model (FSDP2 only; 1 otherwise).
        fsdp: The recipe asks for FSDP2; the states are sharded only when there is more
            than one process, or when they are offloaded (see :attr:`sharded`).
        tp_size: Ranks that split each weight (tensor parallelism, FSDP2 only); they see the
            same tokens.
        offload_params: FSDP2 keeps the sharded states in host memory (``fsdp_config.offload_params``),
            which one process can use too: the base weights leave the GPU but for the layers in flight.
    """

    world_size: int
    cp_size: int
    dp_replicate_size: int = 1
    fsdp: bool = False
    tp_size: int = 1
    offload_params: bool = False

    def __post_init__(self) -> None:
        if min(self.world_size, self.cp_size, self.dp_replicate_size, self.tp_size) < 1:
            raise LaunchError(
                f"world size ({self.world_size}), context_parallel_size, dp_replicate_size and "
                "tensor_parallel_size must be positive."
            )
        if self.dp_replicate_size > 1 and not self.fsdp:
            raise LaunchError("dp_replicate_size applies only with fsdp_version: 2.")
        if self.tp_size > 1:
            self._check_tensor_parallel()
        if self.world_size % self.cp_size != 0:
            raise LaunchError(
                f"context_parallel_size={self.cp_size} does not divide the number of processes "
                f"({self.world_size}). Launch a multiple of {self.cp_size} processes "
                f"(e.g. --nproc-per-node {self.cp_size}), or change context_parallel_size."
            )
        unit = self.cp_size * self.dp_replicate_size
        if self.world_size % unit != 0:
            raise LaunchError(
                f"dp_replicate_size={self.dp_replicate_size} × context_parallel_size={self.cp_size} = {unit} does "
                f"not divide the number of processes ({self.world_size}). Launch a multiple of {unit} processes, "
                "or change dp_replicate_size."
            )
        if self.dp_replicate_size > 1 and self.cp_size > 1 and self.dp_shard_size == 1:
            # accelerate's ParallelismConfig refuses this layout (parallelism_config.py:335).
            raise LaunchError(
                f"dp_replicate_size={self.dp_replicate_size} with context_parallel_size={self.cp_size} leaves "
                "dp_shard_size at 1, which accelerate does not support with context parallelism. Launch more "
                f"processes (dp_shard_size ≥ 2: {2 * unit}), or remove dp_replicate_size to shard the model "
                "states over every rank."
            )

    def _check_tensor_parallel(self) -> None:
        if not self.fsdp:
            raise LaunchError("tensor_parallel_size applies only with fsdp_version: 2.")
        unit = self.cp_size * self.tp_size * self.dp_replicate_size
        if self.world_size % unit != 0:
            raise LaunchError(
                f"dp_replicate_size={self.dp_replicate_size} × context_parallel_size={self.cp_size} × "
                f"tensor_parallel_size={self.tp_size} = {unit} does not divide the number of processes "
                f"({self.world_size}). Launch a multiple of {unit} processes (e.g. --nproc-per-node {unit}), "
                "or change tensor_parallel_size."
            )
        if self.world_size == self.tp_size * self.dp_replicate_size:
            # accelerate's FSDP2 shards over the joint dp_shard × cp axis (parallelism_config.py:379).
            raise LaunchError(
                f"tensor_parallel_size={self.tp_size} uses every process, which leaves FSDP2 no ranks to shard "
                f"over (dp_shard × context_parallel_size = 1). Launch {2 * self.world_size} processes, or set "
                "context_parallel_size: 2."
            )

    @classmethod
    def from_recipe(cls, recipe: Recipe, world_size: int) -> ParallelDims:
        """The layout of ``world_size`` processes for ``recipe``, checked against its ``dp_shard_size``."""
        dims = cls(
            world_size=world_size,
            cp_size=recipe.context_parallel_size,
            dp_replicate_size=recipe.resolved_dp_replicate_size,
            fsdp=recipe.is_fsdp,
            tp_size=recipe.tensor_parallel_size,
            offload_params=recipe.is_fsdp and recipe.resolved_fsdp_config.offload_params,
        )
        if recipe.dp_shard_size is not None and recipe.dp_shard_size != dims.dp_shard_size:
            wanted = recipe.default_process_count
            tp = " × tensor_parallel_size" if dims.tp_size > 1 else ""
            raise LaunchError(
                f"dp_shard_size={recipe.dp_shard_size} needs dp_replicate_size × dp_shard_size × "
                f"context_parallel_size{tp} = {wanted} processes, but {world_size} were asked for. Launch "
                f"{wanted} (e.g. --nproc-per-node {wanted}), or change dp_shard_size (or remove it: it "
                "then follows from the number of processes)."
            )
        return dims

    @property
    def dp_size(self) -> int:
        """Data-parallel groups: each sees its own batches (dp_replicate × dp_shard)."""
        return self.world_size // self.batch_group_size

    @property
    def batch_group_size(self) -> int:
        """Ranks that see the same batches: the cp × tp ranks of one data-parallel group."""
        return self.cp_size * self.tp_size

    @property
    def dp_shard_size(self) -> int:
        return self.dp_size // self.dp_replicate_size

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def sharded(self) -> bool:
        """Model states are sharded with FSDP2: asked for, and more than one process or offloaded states.

        One process shards over a mesh of one, which FSDP2 needs to keep the states in host memory.
        """
        return self.fsdp and (self.world_size > 1 or self.offload_params)

    @property
    def shard_group_size(self) -> int:
        """Ranks that hold one copy of the model states between them (1: every rank holds them whole).

        With tensor parallelism each weight is split over the tp ranks, and FSDP2 shards the
        pieces over dp_shard × cp: the layers in the model's TP plan over all of them (the
        weights outside the plan, such as norms, only over dp_shard × cp).
        """
        return self.dp_shard_size * self.cp_size * self.tp_size if self.sharded else 1

    def cp_rank(self, rank: int) -> int:
        return rank // self.tp_size % self.cp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.batch_group_size

    def describe(self) -> str:
        """One line for logs and ``cptune validate``, e.g. ``4 = 2 dp_shard × 2 cp; ...``."""
        if not self.sharded:
            return (
                f"{self.world_size} = {self.dp_size} data-parallel × {self.cp_size} context-parallel; "
                "model states whole on every rank"
            )
        axes = [f"{self.dp_shard_size} dp_shard", f"{self.cp_size} cp"]
        if self.dp_replicate_size > 1:
            axes.insert(0, f"{self.dp_replicate_size} dp_replicate")
        shards = f"{self.shard_group_size} ranks (dp_shard × cp)"
        if self.tp_size > 1:
            axes.append(f"{self.tp_size} tp")
            shards = (
                f"{self.dp_shard_size * self.cp_size} ranks (dp_shard × cp), each weight first split over "
                f"{self.tp_size} tp ranks"
            )
        return f"{self.world_size} = {' × '.join(axes)}; model states sharded (FSDP2) over {shards}" + (
            f", replicated {self.dp_replicate_size}×" if self.dp_replicate_size > 1 else ""
        )
