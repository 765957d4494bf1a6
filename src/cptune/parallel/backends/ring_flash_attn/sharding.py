"""The ring-flash-attn backend: attention across the CP group with ring-flash-attn's kernels.

``varlen_llama3`` (default) all-gathers K and V ``heads_k_stride`` heads at a time
and attends with ``cu_seqlens`` of the full sequence, so packed documents, padding
and bidirectional attention are all exact, and it is exact in fp32.
Sliding-window layers (causal only): under ``varlen_llama3`` each rank's
queries of a document attend that document's keys from its start up to the rank's last query,
bottom-right aligned (ring-flash-attn's ``llama3_flash_attn_prepare_cu_seqlens``), so flash-attn's
``window_size=(sliding_window - 1, 0)`` counts positions of the whole document, never of a shard,
and cu_seqlens keep it inside the document; under ``batch_zigzag`` cptune's own zigzag ring
(:mod:`.zigzag_window`) gives every block its window in whole-row positions.
Attention sinks (gpt-oss, causal): the sink enters each query's softmax once, after all of its keys are
merged, on both (varlen_llama3's gathered attention, :class:`Llama3Attention`; on batch_zigzag cptune's
ring, window or not, :class:`.zigzag_window.ZigzagRing`): :mod:`cptune.parallel.kernels.sinks`.
``batch_zigzag`` passes K and V around a ring over zigzag chunks; it balances
causal work but knows no document boundaries (unpacked causal rows only) and is
only correct in bf16 with ring-flash-attn 0.1.8 (the recipe validation enforces both).

Without flash-attn, cptune's kernels stand in for flash-attn's private functions
while ring-flash-attn is imported (cptune.parallel.kernels): PyTorch's own
FlashAttention-2 on CUDA in bf16/fp16, pure-PyTorch kernels elsewhere, so the real
ring-flash-attn code runs on GPUs without flash-attn and on CPU with gloo.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cptune import versions
from cptune.errors import BackendUnavailableError, CptuneError
from cptune.parallel.backends.attention import ATTENTION_KWARG, ATTENTION_NAME, AttentionCall
from cptune.parallel.backends.base import SameBatchForEveryCpRank, ShardedInputs
from cptune.parallel.kernels.sinks import SplitAttention, attention_with_sinks
from cptune.parallel.shard import TokenBatch, shard_varlen, shard_zigzag

INSTALL_HINT = (
    f"pip install ring-flash-attn{versions.RING_FLASH_ATTN} "
    f"(flash-attn{versions.FLASH_ATTN.split(',')[0]} is optional on CUDA GPUs)"
)


@dataclass(frozen=True)
class RingKernels:
    """The ring-flash-attn entry points cptune uses."""

    varlen_llama3: Callable[..., torch.Tensor]
    prepare_cu_seqlens: Callable[..., tuple[Any, ...]]
    zigzag: Callable[..., torch.Tensor]
    #: ``(q, k, v, softmax_scale, window, group)``: the zigzag ring with a sliding window (.zigzag_window)
    zigzag_window: Callable[..., torch.Tensor]
    #: ``(scale, window, group)``: that ring as a SplitAttention (window None: full causal), for the layers with
    #: attention sinks, whose sink needs the ring's merged ``lse`` (.zigzag_window.ZigzagRing)
    zigzag_ring: Callable[..., SplitAttention]
    #: ``llama3_flash_attn_varlen_forward`` / ``_backward``: the all-gather attention's ``(out, lse)`` and its
    #: backward, for the layers with attention sinks (gpt-oss), whose sink needs the merged ``lse``
    varlen_llama3_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    varlen_llama3_backward: Callable[..., tuple[torch.Tensor, ...]] | None = None
    #: applies the sink logits once to the merged attention (cptune.parallel.kernels.sinks)
    sink_attention: Callable[..., torch.Tensor] = attention_with_sinks


def load_ring_flash_attn() -> RingKernels:
    """Import ring-flash-attn, with the CPU kernels standing in when flash-attn is absent.

    Raises:
        BackendUnavailableError: ring-flash-attn cannot be imported.
    """
    from cptune.parallel.backends.ring_flash_attn.patches import import_patches
    from cptune.patches.core import IMPORT_TIME_LOG, PatchSet

    if "ring_flash_attn" in sys.modules:
        module = sys.modules["ring_flash_attn"]
    else:
        try:
            # The transformers compatibility patch, and the flash-attn stand-ins when flash-attn is absent.
            with PatchSet(import_patches(), log=logging.getLogger(IMPORT_TIME_LOG)).applied(None):
                module = importlib.import_module("ring_flash_attn")
        except ImportError as err:
            raise BackendUnavailableError(
                f"cp_backend: ring-flash-attn needs the ring-flash-attn package, which cannot be "
                f"imported here ({err}). Install it with: {INSTALL_HINT}."
            ) from None
    from cptune.parallel.backends.ring_flash_attn.zigzag_window import ZigzagRing, zigzag_window_attention

    # The flash-attn kernels ring-flash-attn imported (flash-attn's, or cptune's stand-ins without it).
    zigzag_module = sys.modules["ring_flash_attn.zigzag_ring_flash_attn"]
    flash = (zigzag_module._flash_attn_forward, zigzag_module._flash_attn_backward)
    llama3 = importlib.import_module("ring_flash_attn.llama3_flash_attn_varlen")
    return RingKernels(
        varlen_llama3=module.llama3_flash_attn_varlen_func,
        prepare_cu_seqlens=module.llama3_flash_attn_prepare_cu_seqlens,
        zigzag=module.zigzag_ring_flash_attn_func,
        zigzag_window=functools.partial(zigzag_window_attention, kernels=flash),
        zigzag_ring=functools.partial(ZigzagRing, kernels=flash),
        varlen_llama3_forward=llama3.llama3_flash_attn_varlen_forward,
        varlen_llama3_backward=llama3.llama3_flash_attn_varlen_backward,
    )


def check_heads_k_stride(num_key_value_heads: int, heads_k_stride: int) -> None:
    """``varlen_llama3`` gathers KV heads ``heads_k_stride`` at a time: it must divide them."""
    if num_key_value_heads % heads_k_stride:
        divisors = [d for d in range(1, num_key_value_heads + 1) if num_key_value_heads % d == 0]
        raise CptuneError(
            f"heads_k_stride: {heads_k_stride} does not divide the model's {num_key_value_heads} "
            f"key/value heads. Choose one of {divisors}."
        )


class RingFlashAttnBackend(SameBatchForEveryCpRank):
    """Shards batches and attends across one context-parallel group."""

    attn_implementation = ATTENTION_NAME

    def __init__(
        self,
        *,
        func: str,
        causal: bool,
        heads_k_stride: int,
        cp_size: int,
        cp_rank: int,
        group: dist.ProcessGroup | None,
        pad_token_id: int,
        kernels: RingKernels,
    ):
        self.func = func
        self.causal = causal
        self.heads_k_stride = heads_k_stride
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.group = group
        self.pad_token_id = pad_token_id
        self.kernels = kernels

    def shard(self, batch: TokenBatch) -> ShardedInputs:
        if self.func == "varlen_llama3":
            shard = shard_varlen(batch, self.cp_size, self.cp_rank, self.pad_token_id)
            attend = self._varlen_attend(shard.cu_seqlens.to(batch.input_ids.device))
        else:
            shard = shard_zigzag(batch, self.cp_size, self.cp_rank, self.pad_token_id)
            attend = self._zigzag_attend()
        # batch_zigzag is causal only (the recipe's rules); varlen_llama3's windows are causal only. Both apply
        # sinks to their merged attention.
        call = AttentionCall(attend=attend, takes_window=self.causal, takes_sinks=True)
        tokens = shard.tokens
        kwargs = {"input_ids": tokens.input_ids, "position_ids": tokens.position_ids, ATTENTION_KWARG: call}
        return ShardedInputs(
            model_kwargs=kwargs, shift_labels=tokens.shift_labels, call=call, coords=shard.coords
        )

    def _varlen_attend(self, cu_seqlens: torch.Tensor):
        cu_q, cu_k, max_q, max_k, k_slice = self.kernels.prepare_cu_seqlens(
            cu_seqlens, causal=self.causal, rank=self.cp_rank, world_size=self.cp_size
        )
        kernels, causal, stride, group = self.kernels, self.causal, self.heads_k_stride, self.group

        def attend(q, k, v, scale, window=None, sinks=None):
            # One varlen sequence: the rows were laid end to end by shard_varlen. transformers' window of
            # `window` keys (the query's own included) is flash-attn's window_size_left = window - 1.
            window_size = (-1, -1) if window is None else (window - 1, 0)
            if sinks is not None:
                # The sink enters each query's softmax once, after all of its keys are attended.
                attention = Llama3Attention(
                    kernels, cu_q, cu_k, max_q, max_k, stride, k_slice, scale, causal, window_size, group
                )
                q0, k0, v0 = (t[0].contiguous() for t in (q, k, v))
                return kernels.sink_attention(attention, q0, k0, v0, sinks).unsqueeze(0)
            out = kernels.varlen_llama3(
                q[0].contiguous(),
                k[0].contiguous(),
                v[0].contiguous(),
                cu_q,
                cu_k,
                max_q,
                max_k,
                stride,
                k_slice,
                softmax_scale=scale,
                causal=causal,
                window_size=window_size,
                group=group,
            )
            return out.unsqueeze(0)

        return attend

    def _zigzag_attend(self):
        kernels, group = self.kernels, self.group

        def attend(q, k, v, scale, window=None, sinks=None):
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            if sinks is not None:
                # The sink enters each query's softmax once, after the ring has merged all of its key blocks.
                scale = q.shape[-1] ** -0.5 if scale is None else scale
                return kernels.sink_attention(kernels.zigzag_ring(scale, window, group), q, k, v, sinks)
            if window is not None:
                # Every block's window in whole-row positions (ring-flash-attn's zigzag would align it to
                # each block): .zigzag_window.
                return kernels.zigzag_window(q, k, v, scale, window, group)
            return kernels.zigzag(q, k, v, softmax_scale=scale, causal=True, group=group)

        return attend


@dataclass(frozen=True)
class Llama3Attention:
    """ring-flash-attn's all-gather varlen attention as a :class:`~cptune.parallel.kernels.sinks.SplitAttention`.

    Its forward returns each local query's ``(out, lse)`` over every key it sees (the K/V of the whole
    sequence are gathered, ``heads_k_stride`` heads at a time), so the sink logits apply to the finished
    result; its backward is ring-flash-attn's, given the sink attention's ``out`` and ``lse``.
    """

    kernels: RingKernels
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    heads_k_stride: int
    local_k_slice: slice
    scale: float | None
    causal: bool
    window_size: tuple[int, int]
    group: dist.ProcessGroup | None

    def _arguments(self, q: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        positional = (self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k)
        positional += (self.heads_k_stride, self.local_k_slice)
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        return positional, {"softmax_scale": scale, "causal": self.causal, "window_size": self.window_size}

    def forward(self, q, k, v):
        positional, keywords = self._arguments(q)
        return self.kernels.varlen_llama3_forward(
            self.group, q, k.contiguous(), v.contiguous(), *positional, **keywords
        )

    def backward(self, dout, q, k, v, out, lse):
        positional, keywords = self._arguments(q)
        return self.kernels.varlen_llama3_backward(
            self.group, dout, q, k, v, out, lse, *positional, **keywords
        )
