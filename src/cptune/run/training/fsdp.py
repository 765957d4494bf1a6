"""FSDP2 sharding of the model states, through accelerate's FSDP plugin and the Trainer's own FSDP path.

accelerate builds one ``dp_replicate × dp_shard × cp`` device mesh and shards
every parameter, gradient and optimizer state over its flattened
``dp_shard_cp`` axis (``fsdp2_prepare_model``), so context parallelism splits the
sequences while the model states are split across the same ranks; the Trainer
saves and resumes sharded checkpoints (``save_fsdp_model`` /
``load_fsdp_model``). FSDP2 averages gradients over all ranks, as DDP does, so
cptune's token-weighted loss needs no change (:mod:`cptune.parallel.loss`).

What cptune adds: the settings, and the final save. With sharded state dicts the
Trainer's ``save_model`` writes no weights at all; cptune gathers them instead and
writes a standard Hugging Face folder (the adapter only, for LoRA).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from cptune.config.recipe import Recipe
from cptune.parallel.layout import ParallelDims

log = logging.getLogger("cptune.fsdp")

# The Trainer's folder for a sharded model checkpoint (transformers.trainer.FSDP_MODEL_NAME + "_0").
SHARDED_MODEL_DIR = "pytorch_model_fsdp_0"


def is_sharded_checkpoint(path: Path) -> bool:
    """True for a checkpoint written by an FSDP2 run: each rank's shards, no loadable model files."""
    return (path / SHARDED_MODEL_DIR).is_dir()


def fsdp_training_arguments(recipe: Recipe, dims: ParallelDims) -> dict[str, Any]:
    """``TrainingArguments`` keywords that turn on FSDP2 for this recipe (none when nothing is sharded)."""
    if not dims.sharded:
        return {}
    settings = recipe.resolved_fsdp_config
    offload = settings.offload_params
    if offload and not torch.cuda.is_available():
        # FSDP2's CPU offload pins host memory for copies to the GPU, which fails without one
        # ("Cannot access accelerator device"); on CPU the states are in host memory already.
        log.warning(
            "fsdp_config.offload_params: no GPU here, so the model states are in CPU memory already; "
            "training without offloading (the recipe offloads on GPUs)"
        )
        offload = False
    fsdp_config: dict[str, Any] = {
        "version": 2,
        "reshard_after_forward": settings.reshard_after_forward,
        "auto_wrap_policy": settings.auto_wrap_policy,
        # Checkpoints: each rank writes its own shards (torch.distributed.checkpoint); the final
        # model is gathered by gathered_state_dict.
        "state_dict_type": "SHARDED_STATE_DICT",
        "cpu_offload": offload,
    }
    if settings.transformer_layer_cls_to_wrap:
        fsdp_config["transformer_layer_cls_to_wrap"] = list(settings.transformer_layer_cls_to_wrap)
    return {"fsdp": True, "fsdp_config": fsdp_config}


def gathered_state_dict(model: torch.nn.Module, *, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of an FSDP2 model, on CPU, on rank 0 (empty elsewhere).

    A collective: every rank must call it. ``trainable_only`` leaves out frozen
    parameters (a LoRA run saves its adapter only, so the frozen base is never
    gathered).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)
