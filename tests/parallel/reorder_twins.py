"""The reorder twins of a cp=1 reference: the same function computed with its sums in other orders.

fp32 parity holds a CP run's distance from the reference computed in float64 against the farthest
of the fp32 reference and its fp32 twins (:data:`FP32_TWINS`, two of the three below; the
float64-reference rule of tests/numerics.py). bf16 parity has no float64 reference to hold a CP
run against (a float64 model is another function under bf16 rounding), so the parity workers run
the cp=1 reference again in :data:`TWINS`' orders beside it, and ``check(bf16=True)``
(tests/parallel/test_parity.py) holds the CP run's distance from the reference against the
largest distance of the twins. Each twin is a legal reorder of the
reference's attention, the one computation a CP backend splits besides the gradient sums:

- ``eager``: transformers' eager attention (scores, fp32 softmax, values as separate matmuls);
- ``sdpa-math``: the reference's sdpa with torch's math backend instead of the CPU flash kernel
  (whole score matrix, q and k each scaled by the square root of the scale);
- ``documents``: cptune's cp=1 document attention (``LocalBackend(documents=True)``): one SDPA
  call per document, no ``tokens x tokens`` mask, so masked keys never enter the sums; a sliding
  window counted within each document, as the reference's mask and the CP kernels count it
  (:class:`DocumentTwinBackend`). On rows of one document each (no padding) it makes the one SDPA
  call over the batch the reference makes, and the floor rests on the other two twins.

The token-order twins (:data:`TOKEN_ORDER_TWINS`) serve a cp=1 reference without windows or sinks, causal
or not, where the document twin is the path under test (tests/parallel/backends/test_local_documents.py):
cptune's masked SDPA over each whole row with the row's tokens and the head's features taken in another order
(tests/token_orders.py) and the output put back, the mask following the tokens.

Three twins, not one: the rule compares the CP run against the largest of them, and a CP run
exactly as noisy as each twin lands beyond ``c`` times the largest of ``K`` independent draws far
less often than beyond ``c`` times one (test_parity.py's ``check``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cptune.parallel.backends.attention import (
    ATTENTION_KWARG,
    ATTENTION_NAME,
    AttentionCall,
    sdpa_tokens_first,
)
from cptune.parallel.backends.base import ShardedInputs
from cptune.parallel.backends.document_attention import DocumentAttention, RowDocuments
from cptune.parallel.backends.local.sharding import LocalBackend, document_mask
from cptune.parallel.shard import TokenBatch
from tests.token_orders import TWIN_ORDERS, put_back, take_features, token_order


class DocumentTwinBackend(LocalBackend):
    """``LocalBackend(documents=True)`` whose attention also takes a sliding window (``DocumentAttention``'s,
    counted in positions within each document) and attention sinks, so the twin serves windowed models too."""

    def __init__(self, causal: bool) -> None:
        super().__init__(causal, documents=True)

    def shard(self, batch: TokenBatch) -> ShardedInputs:
        sharded = super().shard(batch)
        attention = DocumentAttention(self.causal)
        documents = RowDocuments.of(batch.position_ids, batch.shape[0])

        def attend(q, k, v, scale, window=None, sinks=None):
            return attention.within(q, k, v, scale, documents, window, sinks)

        # Sinks too (gpt-oss, whose fp32 reference is transformers' eager attention given the documents' masks).
        call = AttentionCall(attend=attend, takes_window=True, takes_sinks=True)
        return dataclasses.replace(
            sharded, model_kwargs={**sharded.model_kwargs, ATTENTION_KWARG: call}, call=call
        )


class TokenOrderTwinBackend(LocalBackend):
    """cp=1 over whole rows through cptune's masked SDPA, each row's tokens and the head's features taken in ``order``
    (tests/token_orders.py) and the output put back: the masked reference's function (each document causal within
    itself, or not) with attention's sums in other orders. No sliding windows, no sinks."""

    def __init__(self, causal: bool, order: str) -> None:
        super().__init__(causal)
        self.attn_implementation = ATTENTION_NAME
        self.order = order

    def shard(self, batch: TokenBatch) -> ShardedInputs:
        sharded = super().shard(batch)
        count = batch.shape[1]
        tokens = token_order(count, self.order)
        mask = document_mask(batch.position_ids)
        if self.causal:
            mask = mask & torch.ones(count, count, dtype=torch.bool).tril()
        mask = mask[..., tokens, :][..., tokens]

        def attend(q, k, v, scale):
            features, (q, k, v) = take_features(self.order, q[:, tokens], k[:, tokens], v[:, tokens])
            out = sdpa_tokens_first(q, k, v, scale, attn_mask=mask)
            return put_back(put_back(out, tokens, 1), features, -1)

        call = AttentionCall(attend=attend)
        return dataclasses.replace(
            sharded, model_kwargs={**sharded.model_kwargs, ATTENTION_KWARG: call}, call=call
        )


@dataclass(frozen=True)
class Twin:
    """How one twin computes the reference: its attention implementation, cp=1 backend and context."""

    name: str
    #: the attention implementation for a causal reference (sdpa); None keeps the reference's
    attention: str | None
    documents: bool
    context: Callable[[], contextlib.AbstractContextManager]
    #: the row's tokens taken in this order (:class:`TokenOrderTwinBackend`); None keeps them
    order: str | None = None

    def backend(self, causal: bool) -> LocalBackend:
        if self.order is not None:
            return TokenOrderTwinBackend(causal, self.order)
        return DocumentTwinBackend(causal) if self.documents else LocalBackend(causal=causal)

    def attn_implementation(self, reference: str) -> str:
        return self.attention or reference


def _math_sdpa() -> contextlib.AbstractContextManager:
    return sdpa_kernel([SDPBackend.MATH])


TWINS = (
    Twin("eager", "eager", False, contextlib.nullcontext),
    Twin("sdpa-math", None, False, _math_sdpa),
    Twin("documents", ATTENTION_NAME, True, contextlib.nullcontext),
)


#: The twins of an fp32 cp=1 reference (the float64-reference rule, tests/numerics.py): two of :data:`TWINS`, each
#: computed on one rank of the launch (:func:`twins_of_rank`), so that a launch adds one twin's time per case, not
#: ``world x 3`` (issue 26's budget). Eager attention is left out: it serves causal references only (transformers'
#: eager path builds a causal mask of its own), where these two serve the bidirectional references too.
FP32_TWINS = (TWINS[1], TWINS[2])


#: Twins of a cp=1 reference without windows or sinks whose path under test is the document twin's own
#: (:class:`TokenOrderTwinBackend`, one per order of tests/token_orders.py).
TOKEN_ORDER_TWINS = tuple(
    Twin(f"tokens-{order}", ATTENTION_NAME, False, contextlib.nullcontext, order) for order in TWIN_ORDERS
)


#: transformers' sdpa attention over the tokens and the head's features in a strided order
#: (:func:`reordered_sdpa_forward`), registered by :func:`sdpa_twin_runs`.
REORDERED_SDPA = "cptune_test_reordered_sdpa"
#: The order of :data:`REORDERED_SDPA`'s tokens and features (tests/token_orders.py): not a reversal, which a
#: kernel adding in a symmetric tree undoes.
SDPA_TWIN_ORDER = TWIN_ORDERS[0]
#: An sdpa reference and :func:`sdpa_twin_runs`' 2 twins are 3 draws of the logits (each distinct from the others:
#: tests/parallel/test_reorder_twins.py), so of a loss or metric computed from them, whose 3 values can still round
#: alike (tests/numerics.py's ``float64_scalar_twins_excess``).
SDPA_TWIN_DRAWS = 3


def reordered_sdpa_forward(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' ``sdpa_attention_forward`` with the tokens (the mask following them; none given: the causal mask
    a decoder's sdpa call implies) and the head's features in :data:`SDPA_TWIN_ORDER`, and the output put back: the
    same attention, its sums over keys, over features and (in the backward) over queries in other orders. Tensors
    (batch, heads, tokens, head_dim)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    queries, keys = query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = getattr(module, "is_causal", True) and queries > 1
        visible = torch.ones(queries, keys, dtype=torch.bool, device=query.device)
        attention_mask = visible.tril(keys - queries) if causal else visible
    q_order, k_order = token_order(queries, SDPA_TWIN_ORDER), token_order(keys, SDPA_TWIN_ORDER)
    mask = attention_mask[..., q_order, :][..., k_order]
    kwargs.pop("is_causal", None)
    features, (query, key, value) = take_features(
        SDPA_TWIN_ORDER, query[:, :, q_order], key[:, :, k_order], value[:, :, k_order]
    )
    out, weights = sdpa_attention_forward(module, query, key, value, mask, *args, is_causal=False, **kwargs)
    return put_back(put_back(out, q_order, 1), features, -1), weights


def sdpa_twin_runs(model: torch.nn.Module, run: Callable[[], Any]) -> list[Any]:
    """``run()`` once through each of 2 twins of ``model``'s sdpa attention that need no backend: sdpa's math backend
    and sdpa over the tokens in a strided order (:data:`REORDERED_SDPA`), the same function with attention's sums in other
    orders; ``model`` set back to sdpa after. Not transformers' eager attention: on CPU it rounds bit for bit as sdpa's
    math backend does (measured on the tiny Llama), so it would be no draw of its own."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert model.config._attn_implementation == "sdpa", "these are the twins of an sdpa reference"
    AttentionInterface.register(REORDERED_SDPA, reordered_sdpa_forward)
    AttentionMaskInterface.register(REORDERED_SDPA, sdpa_mask)  # the masks transformers builds for sdpa
    results = []
    for implementation, context in (
        (TWINS[1].attn_implementation("sdpa"), TWINS[1].context),
        (REORDERED_SDPA, contextlib.nullcontext),
    ):
        model.set_attn_implementation(implementation)
        try:
            with context():
                results.append(run())
        finally:
            model.set_attn_implementation("sdpa")
    return results


def fp32_twins(reference_attention: str) -> tuple[Twin, ...]:
    """The fp32 twins that compute a reference of ``reference_attention``: sdpa's math backend reorders an SDPA
    reference only (transformers' sdpa or cptune's masked SDPA), not gpt-oss's eager one (tests/parallel/masked_eager.py),
    which keeps the document twin alone."""
    if reference_attention in ("sdpa", ATTENTION_NAME):
        return FP32_TWINS
    return tuple(t for t in FP32_TWINS if t.documents)


def twins_of_rank(twins: tuple[Twin, ...], rank: int, world: int) -> list[int]:
    """Which of ``twins`` (their indices) this rank computes: twin ``i`` on rank ``i mod world``. Every rank
    computes the same cp=1 reference, so one rank's twin stands for all; :func:`gather_twins` shares them."""
    return [i for i in range(len(twins)) if i % world == rank]


def gather_twins(mine: dict[int, dict]) -> list[dict]:
    """Every rank's twin results (``mine``: twin index -> what it measured), in twin order, on every rank (a
    collective every rank of the launch runs)."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {i: r for per_rank in everyone for i, r in per_rank.items()}
    return [merged[i] for i in sorted(merged)]


def grad_norm_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """``‖got - want‖ / ‖want‖`` over every gradient together (float64): the norm-based relative error.

    A sum over every element of every tensor, so one draw of it varies far less from run to run than
    the largest element's error does (test_parity.py's ``check`` uses it; ``grad_rel`` is reported).
    """
    diff = sum(float((got[n].double() - w.double()).square().sum()) for n, w in want.items())
    ref = sum(float(w.double().square().sum()) for w in want.values())
    return (diff / max(ref, 1e-300)) ** 0.5
