"""Whether the Trainer's optimizer a recipe names can run here, checked before launching.

cptune passes ``optimizer`` to the Trainer unchanged (transformers' ``OptimizerNames``). An
optimizer from another package needs that package; two need other hardware. Everything else runs
on CPU too: bitsandbytes 0.50 has CPU kernels for its 8-bit optimizers, and on CPU it runs the paged
ones unpaged (paging moves optimizer state between GPU and CPU memory; the updates are the same).
"""

from __future__ import annotations

import importlib.util

from cptune.config.recipe import Recipe
from cptune.errors import BackendUnavailableError

_BITSANDBYTES = ("bitsandbytes", "pip install 'cptune[quantization]' (bitsandbytes>=0.50)")

# optimizer name prefix or name -> (module it imports, how to install it)
_PACKAGES: dict[str, tuple[str, str]] = {
    "adamw_bnb_8bit": _BITSANDBYTES,
    "adamw_8bit": _BITSANDBYTES,
    "ademamix": _BITSANDBYTES,
    "lion_": _BITSANDBYTES,
    "paged_": _BITSANDBYTES,
    "rmsprop_bnb": _BITSANDBYTES,
    "adamw_torch_4bit": ("torchao", "pip install 'torchao>=0.4'"),
    "adamw_torch_8bit": ("torchao", "pip install 'torchao>=0.4'"),
    "galore_": ("galore_torch", "pip install galore-torch"),
    "apollo_": ("apollo_torch", "pip install apollo-torch"),
    "lomo": ("lomo_optim", "pip install lomo-optim"),
    "adalomo": ("lomo_optim", "pip install lomo-optim"),
    "grokadamw": ("grokadamw", "pip install grokadamw"),
    "schedule_free_": ("schedulefree", "pip install schedulefree"),
    "stable_adamw": ("optimi", "pip install torch-optimi"),
    "adamw_anyprecision": ("torchdistx", "install torchdistx (it has no wheels on PyPI)"),
}

_HARDWARE: dict[str, str] = {
    "adamw_torch_xla": "TPUs (torch_xla)",
    "adamw_torch_npu_fused": "Ascend NPUs (torch_npu)",
}


def required_package(optimizer: str) -> tuple[str, str] | None:
    """(module, install hint) of the package an optimizer needs, or None for torch's and transformers' own."""
    for prefix, needed in _PACKAGES.items():
        if optimizer == prefix or (prefix.endswith("_") and optimizer.startswith(prefix)):
            return needed
    return None


def check_optimizer(recipe: Recipe) -> None:
    """Refuse an optimizer that cannot run here, saying why.

    Raises:
        BackendUnavailableError: it needs other hardware, or a package that is not installed.
    """
    name = recipe.optimizer
    if name in _HARDWARE:
        raise BackendUnavailableError(
            f"optimizer: {name} runs on {_HARDWARE[name]} only; use adamw_torch (or adamw_torch_fused) here."
        )
    needed = required_package(name)
    if needed is not None and importlib.util.find_spec(needed[0]) is None:
        module, hint = needed
        raise BackendUnavailableError(
            f"optimizer: {name} needs the {module} package, which is not installed; {hint}, or use adamw_torch."
        )


def optimizer_notes(recipe: Recipe, *, cuda: bool) -> list[str]:
    """What the optimizer does here where that differs from a GPU run (for ``cptune validate``)."""
    if recipe.optimizer.startswith("paged_") and not cuda:
        return [
            f"optimizer: {recipe.optimizer} runs unpaged on CPU (bitsandbytes pages optimizer state between GPU "
            "and CPU memory only on GPUs); the updates are the same."
        ]
    return []
