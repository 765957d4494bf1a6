"""What a process that exists for one recipe keeps from being imported because the recipe does not use it: bitsandbytes.

transformers' Trainer imports peft, and peft imports bitsandbytes when it is installed (the
``quantization`` extra); bitsandbytes 0.50 wraps its default kernels in ``torch.compile`` as it is
imported, which loads TorchDynamo and Inductor. That is about 1.1 s of CPU time in every process
that imports the Trainer (``import transformers.trainer``: 5.8 s with bitsandbytes, 4.7 s without,
measured on a 2-core CPU), paid by every rank of every run, quantized or not.

A rank that cptune's launcher (or torchrun) started exists for one recipe, and so does a process
whose program is the ``cptune`` command (the launcher of ``cptune train``, ``validate``,
``inference``, ...). Where that recipe neither quantizes the base model nor names one of
bitsandbytes' optimizers, bitsandbytes is marked as not importable before anything imports it
(``sys.modules[name] = None``: ``import`` raises ImportError and ``importlib.util.find_spec`` answers
None, which is how transformers, peft and accelerate ask). They then take their paths for a machine
without it, which for a model that is not quantized are the same layers and the same optimizer. Not
done where a user's own process calls the command line's ``main(argv)`` (``cptune_in_process`` in
the tests, a notebook): a later recipe there could need bitsandbytes, and peft would already have
left out its quantized layers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, MutableMapping
from typing import Any

from cptune.config.recipe import Recipe
from cptune.run.training.optimizers import required_package

BITSANDBYTES = "bitsandbytes"


def uses_bitsandbytes(recipe: Recipe) -> bool:
    """Whether the recipe's run needs bitsandbytes: a quantized base, or one of its 8-bit or paged optimizers."""
    needed = required_package(recipe.optimizer)
    return recipe.is_quantized or (needed is not None and needed[0] == BITSANDBYTES)


def leave_out_bitsandbytes(
    recipes: Iterable[Recipe], modules: MutableMapping[str, Any] = sys.modules
) -> bool:
    """In a launched rank, before transformers is imported: keep bitsandbytes out unless a recipe it trains uses it.

    Returns whether it was left out (not when a recipe uses it, or when it is already imported).
    """
    if any(uses_bitsandbytes(recipe) for recipe in recipes) or BITSANDBYTES in modules:
        return False
    modules[BITSANDBYTES] = None
    return True
