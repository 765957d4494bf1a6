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

import json
import sys
from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any

from cptune.config.recipe import Recipe
from cptune.run.training.optimizers import required_package

BITSANDBYTES = "bitsandbytes"


def uses_bitsandbytes(recipe: Recipe, models: Iterable[str | Path] = ()) -> bool:
    """Whether the recipe's run needs bitsandbytes: a quantized base, one of its 8-bit or paged optimizers, or a
    base model (or one of ``models``, e.g. the checkpoint a command loads) that may be saved quantized."""
    needed = required_package(recipe.optimizer)
    if recipe.is_quantized or (needed is not None and needed[0] == BITSANDBYTES):
        return True
    sources = [(recipe.base_model, recipe.model_revision), *((str(m), None) for m in models)]
    return any(may_be_saved_quantized(source, revision) for source, revision in sources)


def may_be_saved_quantized(source: str, revision: str | None = None) -> bool:
    """Whether the model at ``source`` may be saved quantized: its ``config.json`` carries a
    ``quantization_config`` (a pre-quantized hub model such as a ``-bnb-4bit`` one), which transformers loads
    through its quantizer, bitsandbytes for bitsandbytes' formats, whatever the recipe says.

    A local folder and a hub id whose config is in the local hub cache are read (no network); a hub id not in
    the cache answers True, since its config is unknown until the run downloads it. A folder without a
    ``config.json`` (a LoRA adapter, whose base is the recipe's) answers False.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        config = path / "config.json"
    elif path.exists():
        return False
    else:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "config.json", revision=revision)
        if not isinstance(cached, str):
            return True  # not in the cache (or cached as missing): unknown
        config = Path(cached)
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("quantization_config") is not None
    except (OSError, ValueError, AttributeError):
        return True  # unreadable here: let the load say what is wrong, with bitsandbytes importable


def leave_out_bitsandbytes(
    recipes: Iterable[Recipe],
    modules: MutableMapping[str, Any] = sys.modules,
    models: Iterable[str | Path] = (),
) -> bool:
    """In a launched rank, before transformers is imported: keep bitsandbytes out unless a recipe it trains uses it.

    ``models``: other model folders the process loads (a command's ``--checkpoint``).
    Returns whether it was left out (not when a recipe uses it, or when it is already imported).
    """
    models = list(models)
    if BITSANDBYTES in modules or any(uses_bitsandbytes(recipe, models) for recipe in recipes):
        return False
    modules[BITSANDBYTES] = None
    return True
