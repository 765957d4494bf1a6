"""A router loss under a CP attention that lets padding see the real tokens of its row: refused where rows get padding.

The router load-balancing loss counts every token of a micro batch the model sees, the collator's
padding included (:mod:`cptune.parallel.router_loss`: transformers counts it too, given no
attention mask). Padding is never trained, so for the token loss it does not matter what it attends
to; for the router loss it does: its router logits are part of the sums. At cp=1 padding is a
document of its own (its positions restart at 0). torch's context-parallel attention, DeepSpeed
Ulysses around ``sdpa`` and ring-flash-attn's zigzag ring (``batch_zigzag``) take no document mask: causal over the whole row, the padding attends to
the row's real tokens, its hidden states and router logits are not cp=1's, and neither is the
router loss (measured with torch at cp=2 on a tiny Qwen3-MoE and Mixtral whose rows end in padding:
``aux`` 5e-4 and 3e-3 off at the first step, and the routers' gradients over 6e4 times what the
parity check allows).

Rows get collator padding only when a batch holds rows of different lengths (``micro_batch_size``
above 1) or with ``pad_to_sequence_len``; the padding CP adds to split a row evenly is left out of the
sums, so one row per micro batch is exact. Imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cptune.errors import CptuneError

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe


def adds_router_loss(text_config: Any) -> bool:
    """The model's forward adds a router load-balancing loss (output_router_logits with a positive coefficient)."""
    coef = float(getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0)
    return bool(getattr(text_config, "output_router_logits", False)) and coef > 0.0


def check_router_loss_padding(recipe: Recipe, text_config: Any, attention: str) -> None:
    """Refuse a router loss with padded rows under an attention (``attention``, for the message) without documents.

    Raises:
        CptuneError: naming the keys that pad rows and what to do.
    """
    if not adds_router_loss(text_config):
        return
    padding = []
    if recipe.micro_batch_size > 1:
        padding.append(f"micro_batch_size: {recipe.micro_batch_size}")
    if recipe.pad_to_sequence_len:
        padding.append("pad_to_sequence_len: true")
    if not padding:
        return
    raise CptuneError(
        f"{' and '.join(padding)}: the model adds a router load-balancing loss (output_router_logits), which "
        f"counts the padding of each row; {attention} takes no document mask, so the padding would attend to "
        "the row's real tokens and route otherwise than at context_parallel_size: 1, and the router loss "
        "would not be the cp=1 run's. Use micro_batch_size: 1 without pad_to_sequence_len (more "
        "gradient_accumulation_steps instead), or cp_backend: ring-flash-attn with ring_attn_func: varlen_llama3 "
        "(it keeps the padding a document of its own), or set output_router_logits: "
        "false in overrides_of_model_config."
    )
