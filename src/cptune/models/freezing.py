"""Train only the parameters the recipe's ``unfrozen_parameters`` select (a partly frozen full fine-tune).

Applied to the loaded model before the Trainer wraps it (DDP, FSDP2, DeepSpeed): a frozen parameter
gets no gradient and no optimizer state, so it leaves the step exactly as it was loaded. The patterns
read names as Axolotl reads them (:mod:`cptune.config.unfrozen`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cptune.config.recipe import Recipe
from cptune.config.unfrozen import matches, name_regex
from cptune.errors import CptuneError

# How many of the model's parameter names an error shows.
_NAMES_SHOWN = 6


def freeze_all_but(model: torch.nn.Module, patterns: Sequence[str]) -> int:
    """Let only the parameters that ``patterns`` select require gradients; the others are frozen.

    Every name of a parameter counts, a tied weight's second name too (``lm_head.weight`` of a model
    whose output head shares the input embedding): a pattern naming either trains the shared tensor.

    Returns:
        The number of trained elements.

    Raises:
        CptuneError: a pattern selects no parameter; the message names it and some of the model's names.
    """
    named = list(model.named_parameters(remove_duplicate=False))
    selected: set[int] = set()
    for pattern in patterns:
        regex = name_regex(pattern)
        hits = {id(p) for name, p in named if matches(regex, name)}
        if not hits:
            raise CptuneError(_no_match_message(pattern, [name for name, _ in named]))
        selected |= hits
    for _, param in named:
        param.requires_grad_(id(param) in selected)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _no_match_message(pattern: str, names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN]) + (
        f" (and {len(names) - _NAMES_SHOWN} more)" if len(names) > _NAMES_SHOWN else ""
    )
    return (
        f"unfrozen_parameters: '{pattern}' selects no parameter of the model, whose parameters are named {shown}. "
        "A pattern must match the start of a name (a dot is a literal dot, .+ stands for any text): fix or remove "
        "it, so that the run does not train less than you meant."
    )


def apply_unfrozen_parameters(model: Any, recipe: Recipe) -> None:
    """Freeze what the recipe's ``unfrozen_parameters`` leave out (nothing when the key is not set)."""
    if not recipe.unfrozen_parameters:
        return
    freeze_all_but(model, recipe.unfrozen_parameters)  # the run logs the trainable count next
