"""What a context-parallel backend is to the rest of cptune: its name and the :class:`CpBackend` protocol.

A backend is one package under ``parallel/backends/`` whose ``__init__`` defines one object
implementing :class:`CpBackend` completely, and one row of
:data:`cptune.parallel.backends.table.BACKENDS`. Preflight, ``cptune validate``, training,
the memory plan and the patch registry ask that object; nothing outside ``parallel/backends/``
and ``config/`` compares backend names (``tests/test_layers.py`` enforces it).

This module and the packages' ``__init__`` are imported by the recipe's validation, so they
import no torch: what needs it is imported inside the methods, from the package's other modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the recipe's validation imports this module
    from cptune.parallel.backends.base import BatchSharder
    from cptune.patches.core import Patch


class CpBackendName(str, Enum):
    """The values of the recipe's ``cp_backend``; members compare and print as those strings."""

    RING_FLASH_ATTN = "ring-flash-attn"
    TORCH = "torch"
    DEEPSPEED = "deepspeed"

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass(frozen=True)
class BackendPlan:
    """How to load the model and, once the accelerator exists, build the process's sharder.

    ``build(accelerator, model)`` runs when the Trainer is built: the process groups and accelerate's
    mesh exist, and the model (as loaded, with its adapter) is not yet wrapped by DDP, FSDP2 or DeepSpeed.
    """

    attn_implementation: str
    build: Callable[[Any, Any], BatchSharder]


@dataclass(frozen=True)
class TrainerParallelism:
    """What the Trainer's arguments get: accelerate's ``ParallelismConfig`` and a DeepSpeed config (or None)."""

    parallelism: Any = None
    deepspeed: dict[str, Any] | None = None


@runtime_checkable
class CpBackend(Protocol):
    """Everything that differs between context-parallel backends (and cp=1, the local backend).

    The recipe-level members take the validated recipe (``Any`` here: this layer does not
    import the recipe's module). ``dims`` is a :class:`~cptune.parallel.layout.ParallelDims`.
    """

    #: the ``cp_backend`` value; None for the local backend (context_parallel_size: 1)
    name: CpBackendName | None
    #: what computes the attention, for messages (``cp_backend: torch``)
    label: str
    #: cptune's Trainer shards each batch itself (every rank of a CP group gets the whole batch
    #: from accelerate's loader next to plain DDP or FSDP2); False: the backend's engine does
    shards_inputs_itself: bool
    #: the backend drives torch's context-parallel dispatch itself (accelerate's _prepare_cp must not)
    drives_torch_cp: bool
    #: the backend's engine (DeepSpeed) trains the model, not DDP/FSDP2
    runs_own_engine: bool
    #: with ``deepspeed`` or ``zero_stage`` set, DeepSpeed's ZeRO engine trains the model while the
    #: backend shards each batch over its CP group (:mod:`cptune.parallel.backends.zero`)
    runs_under_zero: bool
    #: cptune's attention computes every layer over the whole context: refuse sliding-window and
    #: chunked layers (``check_full_attention``); False where the core attention checks its own
    attends_whole_layers: bool
    #: every rank attends over whole rows for its share of the heads (heads must divide by cp)
    splits_heads: bool

    def recipe_rules(self, recipe: Any) -> Iterator[tuple[str, str]]:
        """Problems of the recipe's keys that concern this backend, as (key, message); the docstring's
        first line titles the rules on the recipe reference page, its list states them."""
        ...

    def chunks_per_rank(self, recipe: Any) -> int:
        """How many chunks of each row a rank holds (``sequence_len`` must hold cp × that many)."""
        ...

    def check_ready(self, recipe: Any, *, training: bool) -> None:
        """Before launching: the backend's packages, precision and configuration files (may import them)."""
        ...

    def check_model(self, recipe: Any, cp_size: int, text_config: Any) -> None:
        """The backend's own checks of a model's config (heads), after the common ones, at cp > 1."""
        ...

    def uses_cptune_attention(self, recipe: Any) -> bool:
        """Whether cptune's own attention function computes the model's attention."""
        ...

    def sequence_split(self, recipe: Any) -> str:
        """How a row's tokens are split over the ranks: ``contiguous``, ``zigzag`` or ``heads``."""
        ...

    def check_prepared_rows(self, recipe: Any, prepared: Any) -> None:
        """Refuse prepared data the backend would stop on at its first batch."""
        ...

    def plan_lines(self, recipe: Any) -> list[str]:
        """The ``attention:`` line (and any warning) of ``cptune validate``'s plan, without indentation."""
        ...

    def trainer_parallelism(self, recipe: Any, dims: Any) -> TrainerParallelism:
        """accelerate's ``ParallelismConfig`` and the DeepSpeed config for the Trainer's arguments."""
        ...

    def plan(self, recipe: Any, dims: Any, pad_token_id: int) -> BackendPlan:
        """The model's attention and the factory of the process's sharder; imports the backend's packages."""
        ...

    def training_patches(self) -> Sequence[Patch]:
        """The patches only this backend needs during a run, each predicated on ``cp_backend``."""
        ...

    def import_patches(self) -> Sequence[tuple[Patch, str]]:
        """Patches applied only around importing the backend's library, with when each applies."""
        ...

    def attention_buffer_bytes(self, shape: Any, setup: Any) -> float:
        """Per-token bytes of the backend's K/V buffers in one layer's forward (twice that backward)."""
        ...

    def zero_stage(self, recipe: Any) -> int | None:
        """The DeepSpeed ZeRO stage that shards the model states (``zero_stage`` or the ``deepspeed`` JSON's;
        reads the JSON), None when DDP/FSDP2 holds them: not None exactly when DeepSpeed's engine trains."""
        ...


def accelerate_parallelism(dims: Any) -> TrainerParallelism:
    """accelerate's mesh for cptune's own sharding next to plain DDP or FSDP2 (None when neither needs one).

    One mesh, dp_replicate × dp_shard × cp × tp (tp innermost). With FSDP2 the model states are
    sharded over dp_shard × cp; with tensor parallelism, accelerate's data loader gives the tp
    ranks the same batch too (``process_index // (tp · cp)``). Without it (plain DDP) the data-parallel axis is declared as
    dp_shard, since accelerate refuses dp_replicate > 1 with cp > 1 unless sharding; the name
    then has no effect on the model. accelerate's data loader gives every rank of a CP group
    the same batch either way (rank // cp, accelerate/data_loader.py).
    """
    if not (dims.cp_enabled or dims.sharded):
        return TrainerParallelism()
    from accelerate import ParallelismConfig

    return TrainerParallelism(
        ParallelismConfig(
            dp_replicate_size=dims.dp_replicate_size,
            dp_shard_size=dims.dp_shard_size,
            cp_size=dims.cp_size,
            tp_size=dims.tp_size,
        )
    )
