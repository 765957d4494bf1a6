"""CP on DeepSpeed's engine (Ulysses, ring-flash-attn and torch CP under ZeRO): the ranks of a CP group load one batch.

cptune's backends shard each batch over their CP group, as next to DDP, while DeepSpeed's engine
trains the model (``cp_backend: deepspeed``, or ``deepspeed`` / ``zero_stage`` with the others; see
:mod:`cptune.parallel.backends.zero`). accelerate 1.15's ``prepare_data_loader`` makes the ranks of
a CP group one data-parallel rank by dividing the rank by the mesh's ``cp`` size
(accelerate/data_loader.py:1150-1165), except under ``DistributedType.DEEPSPEED``, whose branch
reads a ``tp`` axis only (data_loader.py:1130-1140): every rank would get a batch of its own and
ring attention would shard different sequences (on gloo the run aborts in its first all-gather).
The patch registry selects :func:`loader_shares_cp_batches_patch` for every run on DeepSpeed's engine
(backends that declare ``runs_own_engine``, or ``runs_under_zero`` with ZeRO asked for), with the
predicate it builds from them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from cptune import versions
from cptune.patches.core import Patch, Predicate


def _cp_size(mesh: Any) -> int:
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["cp"].size() if "cp" in names else 1


def loader_shares_cp_batches_patch(applies_to: Predicate) -> Patch:
    """``prepare_data_loader`` (as accelerate's Accelerator calls it) → one batch per CP group under DeepSpeed.

    With a device mesh, accelerate's function makes the ranks of a CP group one data-parallel rank
    (``process_index // cp``, ``num_processes = dp``) for every distributed type but DeepSpeed, whose
    branch reads only a ``tp`` axis (accelerate/data_loader.py:1130-1140). The wrapper does for DeepSpeed
    what the other branch does for ``cp``, before the original runs; a mesh without ``cp`` is unchanged.

    Args:
        applies_to: When it applies (the registry passes its :class:`~cptune.patches.deepspeed_patches.OnDeepSpeedEngine`).
    """

    def replacement(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def prepare_data_loader(*args: Any, **kwargs: Any) -> Any:
            from accelerate.state import PartialState
            from accelerate.utils import DistributedType

            bound = signature.bind(*args, **kwargs)
            cp = _cp_size(bound.arguments.get("torch_device_mesh"))
            if cp > 1 and PartialState().distributed_type == DistributedType.DEEPSPEED:
                state = PartialState()
                processes = bound.arguments.get("num_processes") or state.num_processes
                index = bound.arguments.get("process_index")
                index = state.process_index if index is None else index
                bound.arguments["num_processes"] = processes // cp
                bound.arguments["process_index"] = index // cp
            return original(*bound.args, **bound.kwargs)

        return prepare_data_loader

    return Patch(
        name="accelerate-deepspeed-loader-cp-batches",
        target="accelerate.accelerator:prepare_data_loader",
        replacement=replacement,
        reason=(
            "Under DeepSpeed, the ranks of a CP group load one batch, as they do without DeepSpeed.\n"
            "accelerate/data_loader.py:1130 (prepare_data_loader, DistributedType.DEEPSPEED) divides the "
            "rank by the mesh's tp size only, so the ranks of a CP group would shard different sequences."
        ),
        remove_when="accelerate's DeepSpeed branch of prepare_data_loader honours the cp mesh axis.",
        requires=versions.written_for("accelerate"),
        signature=("dataloader", "num_processes", "process_index", "torch_device_mesh"),
        applies_to=applies_to,
    )
