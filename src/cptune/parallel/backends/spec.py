"""What a context-parallel backend is to the rest of cptune: a policy half and a runtime half.

A backend is one package under ``parallel/backends/`` and one row of
:data:`cptune.parallel.backends.rows.ROWS`. The package's ``__init__`` names it (``NAME``), its
``keys`` module holds its recipe keys (``KEYS``, a key group the recipe composes flat); its ``policy``
module defines ``POLICY``, a :class:`BackendPolicy` (what validation, ``cptune validate``, the data
report and the memory estimates ask: rules, checks, plan lines, memory terms; imports no
torch), and its ``runtime`` module ``RUNTIME``, a :class:`BackendRuntime` (what a run needs:
the backend's packages checked, the sharder, the Trainer's parallelism, its patches). Nothing
outside ``parallel/backends/`` and ``config/`` compares backend names (``tests/test_layers.py``
enforces it).

This module is imported by the recipe's validation, so it imports no torch, and the recipe
type only for annotations (the recipe composes the backends' key groups).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the recipe's validation imports this module
    from cptune.config.recipe import Recipe
    from cptune.data.prepare import PreparedData
    from cptune.parallel.backends.base import BatchSharder
    from cptune.parallel.layout import ParallelDims
    from cptune.parallel.memory import ModelShape
    from cptune.patches.core import Patch

SequenceSplit = Literal["contiguous", "zigzag", "heads"]
"""How a backend splits a row over the ranks: one slice each, chunks r and 2C-1-r, or every rank the whole
row for its share of the heads (:mod:`cptune.parallel.balance` computes the work of the first two)."""


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
class BackendPolicy(Protocol):
    """What validation and planning ask a backend (and the local backend at cp=1); imports no torch.

    ``recipe`` is the validated recipe (or, inside :meth:`recipe_rules`, one whose broken keys
    were set to their defaults).
    """

    #: the ``cp_backend`` value; None for the local backend (context_parallel_size: 1)
    name: str | None
    #: what computes the attention, for messages (``cp_backend: torch``)
    label: str
    #: the recipe key whose values pick among this backend's attention functions (``ring_attn_func``), or None
    variant_key: str | None

    def run_name(self, recipe: Recipe) -> str:
        """The backend as results tables name a run of ``recipe`` (``ring-flash-attn / varlen_llama3``, ``torch``)."""
        ...

    #: cptune's Trainer shards each batch itself (every rank of a CP group gets the whole batch
    #: from accelerate's loader next to plain DDP or FSDP2); False: the backend's engine does
    shards_inputs_itself: bool
    #: the backend's engine (DeepSpeed) trains the model, not DDP/FSDP2
    runs_own_engine: bool
    #: with ``deepspeed`` or ``zero_stage`` set, DeepSpeed's ZeRO engine trains the model while the
    #: backend shards each batch over its CP group (:mod:`cptune.parallel.backends.zero`)
    runs_under_zero: bool
    #: cptune's attention computes every layer over the whole context: refuse sliding-window and
    #: chunked layers (``check_full_attention``); False where :meth:`check_model` checks them itself
    #: (the backends that attend sliding windows, and torch with its own reason)
    attends_whole_layers: bool
    #: every rank attends over whole rows for its share of the heads (heads must divide by cp)
    splits_heads: bool
    #: it rings over each tensor-parallel rank's own heads, so tensor_parallel_size > 1 may go with it
    takes_tensor_parallel: bool
    #: it computes the per-pair log-prob sums of preference training (``rl``) at context_parallel_size > 1
    #: (:mod:`cptune.parallel.preference`)
    trains_preference_pairs: bool

    def recipe_rules(self, recipe: Recipe) -> Iterator[tuple[str, str]]:
        """Problems of the recipe's keys that concern this backend, as (key, message); the docstring's
        first line titles the rules on the recipe reference page, its list states them."""
        ...

    def chunks_per_rank(self, recipe: Recipe) -> int:
        """How many chunks of each row a rank holds (``sequence_len`` must hold cp × that many)."""
        ...

    def check_model(self, recipe: Recipe, cp_size: int, text_config: Any) -> None:
        """The backend's own checks of a model's config (heads; attention sinks it cannot apply:
        ``attention.refuse_sinks``), after the common ones, at cp > 1."""
        ...

    def uses_cptune_attention(self, recipe: Recipe) -> bool:
        """Whether cptune's own attention function computes the model's attention."""
        ...

    def sequence_split(self, recipe: Recipe) -> SequenceSplit:
        """How a row's tokens are split over the ranks (the data report's balance)."""
        ...

    def plan_lines(self, recipe: Recipe) -> list[str]:
        """The ``attention:`` line (and any warning) of ``cptune validate``'s plan, without indentation."""
        ...

    def attention_buffer_bytes(
        self, recipe: Recipe, shape: ModelShape, cp_size: int, dtype_bytes: int
    ) -> float:
        """Per-token bytes of the backend's K/V buffers in one layer's forward (twice that backward)."""
        ...

    def zero_stage(self, recipe: Recipe) -> int | None:
        """The DeepSpeed ZeRO stage that shards the model states (``zero_stage`` or the ``deepspeed`` JSON's;
        reads the JSON), None when DDP/FSDP2 holds them: not None exactly when DeepSpeed's engine trains."""
        ...

    def runtime(self) -> BackendRuntime:
        """The backend's runtime half (imports its ``runtime`` module, which may import torch)."""
        ...


@runtime_checkable
class BackendRuntime(Protocol):
    """What a run (and its preflight) needs of a backend: its packages, sharder, parallelism and patches."""

    #: the library whose import :meth:`import_patches` wrap (for messages and the patches page); None: none
    library: str | None
    #: what ``Accelerator._cp_context`` becomes under a backend that shards inputs itself: a function that
    #: raises, saying why (accelerate's torch CP context would shard the batch a second time)
    cp_context_guard: Callable[..., Any]

    def check_ready(self, recipe: Recipe, *, training: bool) -> None:
        """Before launching: the backend's packages, precision and configuration files (may import them)."""
        ...

    def check_prepared_rows(self, recipe: Recipe, prepared: PreparedData) -> None:
        """Refuse prepared data the backend would stop on at its first batch."""
        ...

    def trainer_parallelism(self, recipe: Recipe, dims: ParallelDims) -> TrainerParallelism:
        """accelerate's ``ParallelismConfig`` and the DeepSpeed config for the Trainer's arguments."""
        ...

    def plan(self, recipe: Recipe, dims: ParallelDims, pad_token_id: int, model_config: Any) -> BackendPlan:
        """The model's attention and the factory of the process's sharder; imports the backend's packages.

        ``model_config`` is the model's config (no weights), as the run will load it.
        """
        ...

    def training_patches(self) -> Sequence[Patch]:
        """The patches only this backend needs during a run, each predicated on ``cp_backend``."""
        ...

    def import_patches(self) -> Sequence[Patch]:
        """Patches applied only around importing :attr:`library`, each predicated on when it is needed."""
        ...


def accelerate_parallelism(dims: ParallelDims) -> TrainerParallelism:
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
