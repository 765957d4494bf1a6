"""Axolotl plugins that map onto cptune features, and the refusal of the others."""

from __future__ import annotations

# Axolotl plugins (last part of the class path) that map onto a cptune feature: both fused losses become
# cptune's chunked head loss (Recipe.resolved_head_loss).
CUT_CROSS_ENTROPY_PLUGIN = "CutCrossEntropyPlugin"
LIGER_PLUGIN = "LigerPlugin"
MAPPED_PLUGINS = frozenset({CUT_CROSS_ENTROPY_PLUGIN, LIGER_PLUGIN})


def plugin_refusal(plugin: str) -> str:
    """The one-line refusal of an Axolotl plugin that has no cptune equivalent."""
    return (
        f"'{plugin}': cptune runs no Axolotl plugins; remove it. (CutCrossEntropyPlugin and LigerPlugin are "
        "accepted: they map onto cptune's chunked loss, cut_cross_entropy.)"
    )
