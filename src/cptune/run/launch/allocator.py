"""The CUDA caching allocator's setting for training: expandable segments, unless the user chose their own.

PyTorch's caching allocator keeps device memory in segments it reserved earlier; a request that
fits no free piece of a segment reserves a new one, and out of memory comes when that fails,
however much of the reserved memory is free in pieces too small. At long context a step
allocates and frees tensors of many sizes (a layer's recomputation, MLP tiles, loss chunks, the
offloaded checkpoints coming back), so the free memory splinters. With
``expandable_segments:True`` the allocator grows one segment by mapping more pages instead,
and a freed range can be reused at any size. Measured on an H200 capped to 79.6 GiB (issue 27's
check B: Llama-3.1-8B with LoRA, every memory feature on): without it a step of 278,528 tokens
ran out of memory with only 69.9 GiB allocated at its peak; with it 294,912 tokens trained
(77.5 GiB allocated at the peak), and 311,296 ran out of memory only when the tensors themselves
did not fit (76.0 GiB allocated + 4.75 GiB requested > 79.6 GiB).

``cptune train`` therefore sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in its own
environment before anything touches CUDA, which the ranks it starts (its own, or torchrun's)
inherit. A user's own setting -- ``PYTORCH_CUDA_ALLOC_CONF``, or ``PYTORCH_ALLOC_CONF`` /
``PYTORCH_HIP_ALLOC_CONF``, which torch reads when the first is unset -- is kept as it is; when
it lacks expandable segments and the recipe turns memory features on, one line says so. Without
CUDA the variable is never read.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping, Sequence

log = logging.getLogger("cptune.launch")

VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
#: The variables torch reads the allocator's settings from, in the order it looks (c10/cuda/CUDAAllocatorConfig.h).
USER_VARIABLES = (VARIABLE, "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
SETTING = "expandable_segments:True"


def has_expandable_segments(value: str) -> bool:
    """Whether an allocator setting (``key:value`` pairs separated by commas) turns expandable segments on."""
    pairs = (item.partition(":") for item in value.split(","))
    return any(key.strip() == "expandable_segments" and on.strip() == "True" for key, _, on in pairs)


def use_expandable_segments(
    environ: MutableMapping[str, str], memory_features: Sequence[str], *, note: bool = True
) -> str | None:
    """Set :data:`VARIABLE` to :data:`SETTING` in ``environ`` unless the user set the allocator up.

    Args:
        environ: The environment to change (``os.environ`` before CUDA is initialised).
        memory_features: The recipe's memory features (``Recipe.memory_features``).
        note: Log the line below (the process that starts a run; not each of its ranks again).

    Returns:
        The line logged when the user's own setting lacks expandable segments while memory
        features are on (None otherwise).
    """
    chosen = next(((name, environ[name]) for name in USER_VARIABLES if environ.get(name)), None)
    if chosen is None:
        environ[VARIABLE] = SETTING
        return None
    name, value = chosen
    if not memory_features or has_expandable_segments(value):
        return None
    line = (
        f"cptune: keeping your {name}={value}; it lacks {SETTING}, which cptune sets otherwise: with the memory "
        f"features on ({', '.join(memory_features)}), long steps can run out of memory from fragmentation "
        "with GPU memory still free (docs/concepts.md, 'Memory per GPU')."
    )
    if note:
        log.info("%s", line)
    return line
