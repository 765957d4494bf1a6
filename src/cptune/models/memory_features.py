"""The recipe's memory features on a loaded model: activation offloading, tiled MLP, recomputed norms, chunked head loss.

:func:`check_memory_features` refuses, from the model's config and its meta-device
copy (no weights), a model a feature cannot serve; :func:`install_memory_features`
puts the features on the model a run trains (after LoRA, before any wrapping) and
returns the loss function the trainer computes each shard's loss with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError
from cptune.models.head_loss import HeadLoss, ShardLoss, check_head_loss_supported, logits_loss
from cptune.models.offload import ActivationOffloader, enable_activation_offloading
from cptune.models.recomputed_norms import RecomputedNorm, decoder_norms, enable_recomputed_norms
from cptune.models.tiled_mlp import TiledMlp, decoder_mlps, enable_tiled_mlp

log = logging.getLogger("cptune.models")


@dataclass
class MemoryFeatures:
    """What :func:`install_memory_features` put on a model."""

    loss: ShardLoss = logits_loss
    offloader: ActivationOffloader | None = None
    tiled: list[TiledMlp] = field(default_factory=list)
    norms: list[RecomputedNorm] = field(default_factory=list)

    def remove(self) -> None:
        """Take the hooks off the model (the offloader stays the layers' checkpoint function)."""
        for hooks in [*self.tiled, *self.norms]:
            hooks.remove()
        if isinstance(self.loss, HeadLoss):
            self.loss.remove()


def check_memory_features(recipe: Recipe, config: Any) -> None:
    """Refuse a model that a memory feature of the recipe cannot serve, before any weight is loaded.

    Raises:
        CptuneError: naming the recipe key.
    """
    if not recipe.memory_features:
        return
    from transformers import AutoModelForCausalLM

    from cptune.models.loading import meta_model

    if recipe.resolved_head_loss:
        try:
            check_head_loss_supported(config, AutoModelForCausalLM._model_mapping.get(type(config), None))
        except ValueError as err:
            raise CptuneError(
                f"cut_cross_entropy: {err}; the chunked loss needs a model whose logits are its output layer's "
                "output. Remove cut_cross_entropy (and the plugin or liger key that turns it on)."
            ) from None
    if not (recipe.tiled_mlp or recipe.recompute_norms):
        return
    try:
        model = meta_model(recipe, config)
    except ValueError:
        return  # not a causal LM that transformers knows: load_model says so
    if recipe.tiled_mlp:
        try:
            decoder_mlps(model)
        except ValueError as err:
            raise CptuneError(
                f"tiled_mlp: {type(model).__name__} cannot be tiled ({err}); the MLP of each decoder layer must be "
                "a dense, token-wise module. Remove tiled_mlp (for a mixture of experts, activation offloading "
                "and recompute_norms still apply)."
            ) from None
    if recipe.recompute_norms:
        try:
            decoder_norms(model)
        except ValueError as err:
            raise CptuneError(
                f"recompute_norms: {type(model).__name__} has nothing to recompute ({err}). Remove recompute_norms."
            ) from None


def install_memory_features(model: torch.nn.Module, recipe: Recipe) -> MemoryFeatures:
    """Put the recipe's memory features on ``model`` (after LoRA, before DDP/FSDP/DeepSpeed wrap it)."""
    features = MemoryFeatures()
    if recipe.offloads_activations:
        features.offloader = enable_activation_offloading(model, two_level=recipe.two_level_offloading)
    if recipe.tiled_mlp:
        features.tiled = enable_tiled_mlp(model, recipe.tiled_mlp_num_shards)
    if recipe.recompute_norms:
        features.norms = enable_recomputed_norms(model)
    if recipe.resolved_head_loss:
        features.loss = HeadLoss(model)
    if recipe.memory_features:
        log.info("memory features: %s", ", ".join(recipe.memory_features))
    return features
