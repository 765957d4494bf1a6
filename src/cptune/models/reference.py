"""The reference model of preference training: the policy with its LoRA adapter switched off, no copy."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from cptune.errors import CptuneError


def adapter_disabled(model: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """A context factory under which ``model`` (a peft model, unwrapped) computes as its base model.

    peft's ``disable_adapter()`` makes every LoRA layer return its base layer's output (and
    skips the LoRA dropout), so the same forward machinery (the backend's attention, the chunked
    loss, gradient checkpointing) computes the reference of preference training.

    Raises:
        CptuneError: ``model`` has no adapter to disable.
    """
    if not callable(getattr(model, "disable_adapter", None)):
        raise CptuneError(
            "rl: the reference model is the base model with the LoRA adapter disabled, but this model has no "
            "adapter; set adapter: lora (or qlora)."
        )
    return model.disable_adapter
