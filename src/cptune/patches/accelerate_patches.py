"""Patches of accelerate 1.15 that let context parallelism run on plain DDP, with cptune's backends.

cptune hands accelerate a ``ParallelismConfig`` with ``cp_size > 1`` so that
accelerate builds the device mesh and its data loader gives every rank of a
CP group the same batch (accelerate/data_loader.py:1164). Everything else
accelerate does for ``cp_size > 1`` assumes torch's ``context_parallel`` on
FSDP2; these patches switch off what cptune's backends do not want.

Each function returns one :class:`~cptune.patches.core.Patch`. Recipe values
a wrapper needs (the backend) are bound when the patch is built, by
:func:`cptune.patches.registry.build_patch_set`, since a replacement factory
only receives the original object. accelerate is imported lazily inside the
wrappers, so importing this module does nothing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from cptune import versions
from cptune.errors import PatchError
from cptune.patches.core import Patch, Predicate, ShardsModelStates


def torch_cp_context_unavailable(*args: Any, **kwargs: Any) -> Any:
    """Put in ``Accelerator._cp_context`` so that nothing silently falls back to torch CP.

    The guard of a backend that shards inputs itself without torch's context parallelism (a backend
    whose own dispatch is torch's has its own: its runtime's ``cp_context_guard``).
    """
    raise PatchError(
        "accelerator.maybe_context_parallel() was called, but cptune's cp_backend shards the sequence "
        "itself and has no torch context_parallel context. Remove the call (cptune's Trainer already "
        "shards every batch), or set cp_backend: torch in the recipe."
    )


def _prepare_cp_leaving_objects(accelerator: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``_prepare_cp`` for a backend that shards inputs itself: leave the objects as they are.

    The original (accelerate/accelerator.py:1659-1672) would call torch's
    process-global ``set_rotate_method``, store a torch ``context_parallel``
    partial in ``_cp_context`` and attach ``_attach_context_parallel_hooks``
    (big_modeling.py:787), whose pre-hooks (big_modeling.py:828-831) replace every
    ``attention_mask`` with ``is_causal=True``: a padded, packed or bidirectional
    batch would train wrong without a word. ring-flash-attn and the local backend
    keep their masks in cptune's attention; cptune's torch backend checks each
    batch's documents instead (``parallel/backends/torch_cp/sharding.py:check_batch``,
    which raises naming ring-flash-attn), its attention function refuses any mask,
    and it sets the rotate method around each micro batch and restores it, rather
    than process-wide. The original returns ``args`` as a tuple unchanged; so does
    this one. Nothing is stored on the accelerator: :func:`cp_context_guard_patch`
    puts the guard on the class while the patches are applied, so none is left on
    the instance after (torch's ``context_parallel`` would re-shard inputs cptune
    has sharded).
    """
    return args


def prepare_cp_patch(applies_to: Predicate, *, shards_itself: bool) -> Patch:
    """``Accelerator._prepare_cp`` → backend-aware preparation, bound to the recipe's backend.

    Args:
        applies_to: The backends that shard inputs themselves, at cp > 1.
        shards_itself: The recipe's backend shards inputs itself (else accelerate's runs unchanged).
    """
    handler = _prepare_cp_leaving_objects if shards_itself else None

    def replacement(original: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
        @functools.wraps(original)  # keeps __wrapped__, so a re-plan checks the original's signature
        def _prepare_cp(self: Any, *args: Any) -> tuple[Any, ...]:
            if handler is None:
                return original(self, *args)
            return handler(self, args)

        return _prepare_cp

    return Patch(
        name="accelerator-prepare-cp-by-backend",
        target="accelerate.accelerator:Accelerator._prepare_cp",
        replacement=replacement,
        reason=(
            "No torch CP context, rotate method or mask-dropping hooks for backends that shard themselves.\n"
            "accelerate/accelerator.py:1659 _prepare_cp assumes cp_backend=torch: it sets torch's global "
            "rotate method, a context_parallel context, and hooks (big_modeling.py:787) that drop "
            "attention masks."
        ),
        remove_when="accelerate's ParallelismConfig accepts a cp_backend that shards inputs itself.",
        requires=versions.written_for("accelerate"),
        signature=("self", "args"),
        applies_to=applies_to,
    )


def cp_context_guard_patch(
    applies_to: Predicate, *, guard: Callable[..., Any] = torch_cp_context_unavailable
) -> Patch:
    """``Accelerator._cp_context`` → a guard that raises, for backends that shard the sequence themselves.

    ``Accelerator.maybe_context_parallel`` (accelerate/accelerator.py:4203-4210) enters
    ``self._cp_context``, which only the original ``_prepare_cp`` sets (:1666); with
    :func:`prepare_cp_patch` nothing sets it. The guard is created on the class while
    the patches are applied and deleted on revert, so no accelerator keeps it after a
    run (it once stayed on the instance).

    Args:
        applies_to: The backends that shard inputs themselves, at cp > 1.
        guard: What ``_cp_context`` becomes: the recipe's backend's ``cp_context_guard``, which raises.
    """
    return Patch(
        name="accelerator-cp-context-guard",
        target="accelerate.accelerator:Accelerator._cp_context",
        replacement=lambda original: guard,
        reason=(
            "accelerator.maybe_context_parallel() fails with a clear message instead of sharding a batch twice.\n"
            "accelerate/accelerator.py:4207 enters self._cp_context, set only by the _prepare_cp that "
            "accelerator-prepare-cp-by-backend replaces."
        ),
        remove_when="accelerator-prepare-cp-by-backend is removed.",
        requires=versions.written_for("accelerate"),
        applies_to=applies_to,
        create=True,
    )


class _MultiCpuAsMultiDevice:
    """View of an Accelerator whose ``multi_device`` also counts ``MULTI_CPU``; all else delegates."""

    multi_device = True

    def __init__(self, accelerator: Any):
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


def validate_accelerator_multi_cpu_patch(applies_to: Predicate) -> Patch:
    """``ParallelismConfig._validate_accelerator`` → accept ``MULTI_CPU`` for CP-only configs.

    The original (accelerate/parallelism_config.py:355, raising at :393-397)
    says "ParallelismConfig is only compatible DistributedType.FSDP ... or
    DistributedType.Multi{Device}" because ``Accelerator.multi_device``
    (accelerator.py:659) leaves out ``MULTI_CPU``. The wrapper runs the
    original with a view of the accelerator whose ``multi_device`` is true, so
    all its other checks (total size = number of processes, FSDP dims, handler
    warnings) still run. Measured on CPU (notes/cpu-measurements.md, A): with
    it, 2 gloo processes get a ``cp`` mesh and a DDP-wrapped model.
    """

    def replacement(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        @functools.wraps(original)
        def _validate_accelerator(self: Any, accelerator: Any) -> None:
            from accelerate.utils import DistributedType

            cp_only = self.cp_enabled and not self.tp_enabled and not self.sp_enabled
            if cp_only and accelerator.distributed_type == DistributedType.MULTI_CPU:
                return original(self, _MultiCpuAsMultiDevice(accelerator))
            return original(self, accelerator)

        return _validate_accelerator

    return Patch(
        name="parallelism-config-allow-multi-cpu",
        target="accelerate.parallelism_config:ParallelismConfig._validate_accelerator",
        replacement=replacement,
        reason=(
            "Lets CP run on CPU processes (gloo) with plain DDP.\n"
            "accelerate/parallelism_config.py:393 rejects DistributedType.MULTI_CPU because "
            "Accelerator.multi_device (accelerator.py:659) omits it; measured on CPU with 2 processes."
        ),
        remove_when="accelerate accepts MULTI_CPU in ParallelismConfig._validate_accelerator.",
        requires=versions.written_for("accelerate"),
        signature=("self", "accelerator"),
        # With FSDP2 the CPU run is an FSDP run (accelerator-state-fsdp-on-cpu), which the original accepts.
        applies_to=applies_to,
    )


class _HiddenParallelismConfig:
    """Falsy stand-in for the parallelism config while ``AcceleratorState.__init__`` runs.

    ``__init__`` reads it only as ``if self.parallelism_config and ...`` and
    ``self.parallelism_config is not None and self.parallelism_config.cp_enabled``
    (accelerate/state.py:998-1012); both are false for this object.
    """

    cp_enabled = False

    def __bool__(self) -> bool:
        return False


def accelerator_state_cp_without_fsdp_patch(applies_to: Predicate) -> Patch:
    """``AcceleratorState.__init__`` → CP with plain DDP on GPUs, without an FSDP plugin.

    On MULTI_GPU-like setups accelerate/state.py:997-1016 raises "cp_size > 1
    ... but no fsdp_plugin was provided" unless the environment variable
    ACCELERATE_ALLOW_CP_STANDALONE=true; with the variable, it forces
    ``distributed_type = FSDP`` with ``fsdp_plugin = None``, and then
    ``AcceleratorState.is_fsdp2`` (state.py:1103) raises AttributeError
    (measured) and ``prepare_model`` would take the FSDP branch.

    The wrapper, when ``cp_size > 1`` and no ``fsdp_plugin`` is given, runs the
    original with a falsy stand-in config (those lines are the only reads of
    the config in ``__init__``: state.py:924, 998, 1003, 1011), so
    ``distributed_type`` stays MULTI_GPU (DDP, as for any run without FSDP), and
    then stores the real config where the original put the stand-in. Later
    readers (mesh building, ``_validate_accelerator``, the data loader, the
    Trainer) see the real config; ``is_fsdp2`` is False without touching
    ``fsdp_plugin``. With an ``fsdp_plugin`` the original runs unchanged.

    Inferred from the source, not run on a GPU. On CPU (MULTI_CPU) the
    original never reaches these lines, so the wrapper changes nothing there;
    that path is measured.
    """

    def replacement(original: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            config = bound.arguments.get("parallelism_config")
            if config is None or not config.cp_enabled or bound.arguments.get("fsdp_plugin") is not None:
                return original(self, *args, **kwargs)
            stand_in = _HiddenParallelismConfig()
            bound.arguments["parallelism_config"] = stand_in
            try:
                original(*bound.args, **bound.kwargs)
            finally:
                # The original stores the config only on first initialisation; the stand-in is
                # found exactly when it did, also when it raised later on, as upstream would leave it.
                if vars(self).get("parallelism_config") is stand_in:
                    self.parallelism_config = config

        return __init__

    return Patch(
        name="accelerator-state-cp-without-fsdp",
        target="accelerate.state:AcceleratorState.__init__",
        replacement=replacement,
        reason=(
            "Lets CP run with plain DDP on GPUs without an FSDP plugin or environment variables.\n"
            "accelerate/state.py:997 requires an fsdp_plugin for cp_size > 1 unless "
            "ACCELERATE_ALLOW_CP_STANDALONE=true, which forces FSDP with no plugin and breaks is_fsdp2 "
            "(state.py:1103). Inferred from source; not run on a GPU."
        ),
        remove_when="accelerate supports cp_size > 1 without FSDP (drops the 'TODO: Siro' check in state.py).",
        requires=versions.written_for("accelerate"),
        signature=("self", "fsdp_plugin", "parallelism_config"),
        applies_to=applies_to,
    )


def accelerator_state_fsdp_on_cpu_patch() -> Patch:
    """``AcceleratorState.__init__`` → FSDP2 on CPU processes (gloo) when an FSDP plugin is given.

    accelerate/state.py:986-1016 turns an ``fsdp_plugin`` into ``distributed_type =
    FSDP`` only inside its branch for GPU-like devices; a MULTI_CPU run keeps
    MULTI_CPU, drops the plugin, and the model is wrapped in DDP whole. FSDP2's
    ``fully_shard`` itself runs on CPU with gloo (measured: dp_shard=2 × cp=2 on 4
    processes equals one process to 1e-7), so the wrapper finishes what the GPU
    branch does (state.py:1007-1011): after the original, a MULTI_CPU state given
    a plugin becomes FSDP, keeps the plugin and passes it the mixed precision. On
    GPUs the original already did this and the wrapper changes nothing.
    """

    def replacement(original: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            from accelerate.utils import DistributedType

            original(self, *args, **kwargs)
            plugin = signature.bind(self, *args, **kwargs).arguments.get("fsdp_plugin")
            if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
                self.distributed_type = DistributedType.FSDP
                if self._mixed_precision != "no":
                    plugin.set_mixed_precision(self._mixed_precision)
                self.fsdp_plugin = plugin

        return __init__

    return Patch(
        name="accelerator-state-fsdp-on-cpu",
        target="accelerate.state:AcceleratorState.__init__",
        replacement=replacement,
        reason=(
            "Lets FSDP2 shard model states across CPU processes (gloo), so sharded runs dry-run on a laptop.\n"
            "accelerate/state.py:986 sets distributed_type = FSDP only for GPU-like devices; on MULTI_CPU the "
            "fsdp_plugin is dropped. Measured on CPU: dp_shard=2 x cp=2 equals one process."
        ),
        remove_when="accelerate selects FSDP for MULTI_CPU runs given an fsdp_plugin.",
        requires=versions.written_for("accelerate"),
        signature=("self", "fsdp_plugin", "parallelism_config"),
        applies_to=ShardsModelStates(),
    )


def _prepare_tp_passthrough(accelerator: Any, *args: Any) -> tuple[Any, ...]:
    """``_prepare_tp`` when cptune split the model itself: leave every object to ``_prepare_fsdp2``."""
    return args


def prepare_tp_passthrough_patch(applies_to: Predicate) -> Patch:
    """``Accelerator._prepare_tp`` → nothing to do: cptune applied the model's TP plan before ``prepare``.

    accelerate/accelerator.py:1532 calls ``_prepare_tp`` whenever the parallelism config has
    ``tp_size > 1``. Under FSDP2 its original (accelerator.py:1581-1657) imports
    ``transformers.integrations.tensor_parallel.ReplicateParallel``, which transformers 5.23 no
    longer defines (ImportError), to turn every weight outside the TP plan into a DTensor
    replicated over ``tp``; it also prepares the data loaders and optimizer once more before
    ``_prepare_fsdp2`` prepares them again. FSDP2 shards plain and tensor-parallel weights side
    by side (measured: tp=2 × cp=2 equals one process to 1e-6, :mod:`cptune.parallel.tensor_parallel`),
    so the replacement returns the objects unchanged and ``prepare`` goes on to ``_prepare_fsdp2``.
    """
    return Patch(
        name="accelerate-prepare-tp-passthrough",
        target="accelerate.accelerator:Accelerator._prepare_tp",
        replacement=lambda original: _prepare_tp_passthrough,
        reason=(
            "cptune applies the model's tensor-parallel plan itself; FSDP2 then prepares everything.\n"
            "accelerate/accelerator.py:1622 imports transformers.integrations.tensor_parallel.ReplicateParallel "
            "under FSDP2, which transformers 5.23 removed, and prepares loaders and optimizer twice."
        ),
        remove_when="accelerate's _prepare_tp works with transformers' DTensor tensor-parallel styles under FSDP2.",
        requires=versions.written_for("accelerate"),
        signature=("self", "args"),
        applies_to=applies_to,
    )
