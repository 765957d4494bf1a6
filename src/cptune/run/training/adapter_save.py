"""The adapter a LoRA run saves under DeepSpeed ZeRO-3: what peft saves without ZeRO.

peft saves more than the trainable weights with an adapter: with ``save_embedding_layers="auto"``
(peft/utils/save_and_load.py:295-332) also the input and output embeddings when their vocabulary no
longer matches the base model's (the recipe's ``special_tokens`` / ``tokens`` grew them), frozen or
not, and with them the originals of ``lora_modules_to_save`` embeddings. It picks them from the state
dict it is handed. Under ZeRO-3, transformers 5.23 hands it DeepSpeed's consolidated state dict of
the *trainable* parameters only (``exclude_frozen_parameters=True``, transformers/trainer.py:4107-4110),
so the grown embeddings were silently left out of the saved adapter. :func:`zero3_adapter_state_dict`
gathers exactly the frozen parameters peft would save as well (peft itself says which, asked with
stand-ins), so the adapter holds what it holds without ZeRO, and nothing else of the base is gathered.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


def frozen_parameters_peft_saves(model: Any) -> list[str]:
    """Names of the frozen parameters that peft's ``save_pretrained`` of ``model`` writes with its adapter.

    peft is asked with a state dict of shape-only stand-ins (DeepSpeed ZeRO-3 keeps the real shape of a
    partitioned parameter in ``ds_shape``); the stand-ins it returns are the ones it would save.
    """
    from peft import get_peft_model_state_dict

    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each name
    stand_ins = {
        name: torch.empty(tuple(getattr(p, "ds_shape", p.shape)), dtype=p.dtype, device="meta")
        for name, p in params.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns when it adds the embeddings; the real save warns again
        picked = {id(t) for t in get_peft_model_state_dict(model, state_dict=stand_ins).values()}
    return [name for name, t in stand_ins.items() if id(t) in picked and not params[name].requires_grad]


def zero3_adapter_state_dict(engine: Any, model: Any) -> dict[str, torch.Tensor] | None:
    """The state dict for peft's save of a ZeRO-3 LoRA model: trainable weights and the frozen ones peft saves.

    A collective: every rank must call it. Returns the dict on rank 0 and None elsewhere, as
    DeepSpeed's consolidation does.

    Args:
        engine: The DeepSpeed engine that trains ``model`` (the Trainer's ``deepspeed``).
        model: The ``PeftModel`` (``engine.module``).
    """
    import deepspeed
    import torch.distributed as dist

    # The trainable weights and the buffers, gathered by DeepSpeed one module at a time (as the Trainer does).
    state = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    params = dict(model.named_parameters(remove_duplicate=False))
    gathered: dict[int, torch.Tensor | None] = {}
    for name in frozen_parameters_peft_saves(model):
        param = params[name]
        if id(param) not in gathered:  # a tied weight is gathered once
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                gathered[id(param)] = param.detach().cpu().clone() if dist.get_rank() == 0 else None
        if state is not None:
            state[name] = gathered[id(param)]
    return state
