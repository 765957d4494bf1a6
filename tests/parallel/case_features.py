"""A parity case's memory features, put on the CP model with cptune's own installer (both parity workers).

A case's ``features`` may hold ``offload`` (activation offloading, with gradient checkpointing;
``"two_level"``: two-level checkpointing), ``tiles`` (tiled MLP with that many tiles), ``norms``
(recomputed norms) and ``head_loss`` (the chunked loss from the hidden
states; ``head_loss_chunk``: that many logits per chunk instead of the default). The cp=1 reference keeps none of them, so a case compares feature on at cp=N with
feature off at cp=1.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from cptune.models.head_loss import ShardLoss, logits_loss
from cptune.models.memory_features import install_memory_features
from tests import reorder


def install_case_features(model: torch.nn.Module, case: dict) -> ShardLoss:
    """Put the case's features on ``model``; returns the shard loss function to use."""
    features = case.get("features") or {}
    if not features:
        return logits_loss
    if features.get("offload"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    names = [name for name in ("offload", "tiles", "norms", "head_loss") if features.get(name)]
    recipe = SimpleNamespace(
        offloads_activations=bool(features.get("offload")),
        two_level_offloading=features.get("offload") == "two_level",
        tiled_mlp=bool(features.get("tiles")),
        tiled_mlp_num_shards=features.get("tiles") and reorder.tiles(features["tiles"]),
        recompute_norms=bool(features.get("norms")),
        resolved_head_loss=bool(features.get("head_loss")),
        memory_features=tuple(names),
    )
    loss = install_memory_features(model, recipe).loss
    if features.get("head_loss_chunk"):
        loss.chunk_elements = features["head_loss_chunk"]
    return loss


def grads_digest(grads: dict[str, torch.Tensor]) -> str:
    """A digest of gradient bits: equal digests mean bit-identical gradients."""
    digest = hashlib.sha256()
    for name in sorted(grads):
        digest.update(name.encode())
        digest.update(grads[name].detach().contiguous().float().numpy().tobytes())
    return digest.hexdigest()


WINDOWED_ARCHS = ("mistral", "gemma3", "gpt_oss")
"""The families with sliding-window layers the parity cases build (``arch``)."""


def windowed_model(case: dict, vocab_size: int) -> torch.nn.Module:
    """The tiny model of a windowed family a case names: Mistral (a window on every layer), Gemma 3 text
    (sliding, sliding, full) or gpt-oss (sinks on every layer; sliding, full; 4 experts, router loss on), with
    the case's window (5 keys unless ``window`` says otherwise)."""
    from devtools.tiny import build_tiny_gemma3_text, build_tiny_gpt_oss, build_tiny_mistral

    builders = {
        "mistral": build_tiny_mistral,
        "gemma3": build_tiny_gemma3_text,
        "gpt_oss": build_tiny_gpt_oss,
    }
    model = builders[case["arch"]](vocab_size, seed=1234, sliding_window=case.get("window", 5))
    if case["arch"] == "gpt_oss":
        model.set_experts_implementation("eager")  # torch's grouped_mm takes no float64 reference
    return model
