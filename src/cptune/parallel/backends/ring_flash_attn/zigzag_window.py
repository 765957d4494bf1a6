"""Sliding windows and attention sinks on the zigzag ring: cptune's ring, every block's window in whole-row positions.

ring-flash-attn 0.1.8's ``zigzag_ring_flash_attn_func`` hands each ring step's block to flash-attn with
one ``window_size``, aligned to the block, so a window would count positions within blocks. This ring
passes K and V (and, backwards, their gradients) around the CP group as that function does, and
attends every pair of a local query chunk and a visiting key chunk as :func:`.zigzag_blocks.chunk_block`
says: skipped when wholly outside the window, cut and windowed where it crosses the window's edge.
It calls the flash-attn kernels ring-flash-attn imported (flash-attn's, or cptune's stand-ins where
flash-attn is absent: :mod:`cptune.parallel.kernels`), and merges the blocks by log-sum-exp in fp32.
Full-attention layers keep ring-flash-attn's own zigzag function, except those with attention sinks
(gpt-oss): the sink goes once into each query's softmax over all of its keys, so it needs the ring's merged
``(out, lse)``, which :class:`ZigzagRing` returns (window or not) and ring-flash-attn's function does not;
:func:`cptune.parallel.kernels.sinks.attention_with_sinks` applies it (a sink applied to each block, or each
ring step, would enter the softmax once per block).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cptune.parallel.backends.ring_flash_attn.zigzag_blocks import ChunkBlock, chunk_block, merge_block


def zigzag_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None,
    window: int,
    group: dist.ProcessGroup | None,
    kernels: tuple[Callable[..., Any], Callable[..., Any]],
) -> torch.Tensor:
    """Causal attention with a window of ``window`` keys over this rank's two zigzag chunks.

    Args:
        q: ``(batch, 2 * chunk_len, heads, head_dim)``: this rank's chunks ``r`` and ``2 * cp_size - 1 - r``.
        k: Like ``q`` with the key heads; ``v`` likewise.
        softmax_scale: Scale of ``q @ k^T``; None means ``head_dim ** -0.5``.
        window: transformers' ``sliding_window``.
        group: The CP group.
        kernels: flash-attn's ``_flash_attn_forward`` and ``_flash_attn_backward`` (2.8 signatures).
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return _ZigzagAttention.apply(q, k, v, ZigzagRing(scale, window, group, kernels))


@dataclass(frozen=True)
class ZigzagRing:
    """The zigzag ring's causal attention as a :class:`~cptune.parallel.kernels.sinks.SplitAttention`.

    :meth:`forward` returns every local query's ``(out, lse)`` over all of its keys, the ring's blocks merged
    (``out`` in fp32, batched layout); :meth:`backward` runs the ring again given an ``(out, lse)``, so attention
    sinks (gpt-oss) go once onto the merged result (:func:`cptune.parallel.kernels.sinks.attention_with_sinks`).

    Attributes:
        scale: Scale of ``q @ k^T``.
        window: transformers' ``sliding_window``; None: full causal attention.
        group: The CP group.
        kernels: flash-attn's ``_flash_attn_forward`` and ``_flash_attn_backward`` (2.8 signatures).
    """

    scale: float
    window: int | None
    group: dist.ProcessGroup | None
    kernels: tuple[Callable[..., Any], Callable[..., Any]]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        forward_kernel, _ = self.kernels
        ring = _Ring(self.group)
        chunk_len = q.shape[1] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
        k, v = k.contiguous(), v.contiguous()
        for step in range(ring.size):
            incoming = ring.pass_on(k, v) if step + 1 < ring.size else None
            for q_rows, k_rows, block in _blocks(ring, step, chunk_len, self.window):
                block_out, block_lse = _forward(
                    forward_kernel, q[:, q_rows], k[:, k_rows], v[:, k_rows], self.scale, block
                )
                merge_block(out, lse, q_rows, block_out, block_lse)
            if incoming is not None:
                k, v = ring.received(incoming)
        return out, lse

    def backward(self, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, backward_kernel = self.kernels
        ring = _Ring(self.group)
        chunk_len = q.shape[1] // 2
        dout, k, v = dout.contiguous(), k.contiguous(), v.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        travelling = None  # the gradients of the K/V block this rank holds, summed by the ranks before it
        for step in range(ring.size):
            incoming = ring.pass_on(k, v) if step + 1 < ring.size else None
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for q_rows, k_rows, block in _blocks(ring, step, chunk_len, self.window):
                grads = _backward(
                    backward_kernel,
                    dout[:, q_rows],
                    q[:, q_rows],
                    k[:, k_rows],
                    v[:, k_rows],
                    out[:, q_rows],
                    lse[:, :, q_rows],
                    self.scale,
                    block,
                )
                dq[:, q_rows] += grads[0]
                dk[:, k_rows] += grads[1]
                dv[:, k_rows] += grads[2]
            if travelling is not None:
                dk_before, dv_before = ring.received(travelling)
                dk += dk_before
                dv += dv_before
            travelling = ring.pass_on(dk, dv) if ring.size > 1 else None
            if incoming is not None:
                k, v = ring.received(incoming)
        if travelling is not None:
            # After the last step, the gradients of this rank's own K/V arrive from the rank before it.
            dk, dv = ring.received(travelling)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _ZigzagAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: ZigzagRing):
        out, lse = ring.forward(q, k, v)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.ring.backward(dout, q, k, v, out, lse), None)


class _Ring:
    """Point-to-point exchange with the neighbours in the CP group: send to rank + 1, receive from rank - 1."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        send, recv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.send_to = dist.get_global_rank(group, send) if group is not None else send
        self.recv_from = dist.get_global_rank(group, recv) if group is not None else recv

    def pass_on(self, *tensors: torch.Tensor) -> tuple[list[Any], list[torch.Tensor]]:
        """Start sending ``tensors`` on and receiving the previous rank's; :meth:`received` waits for them."""
        buffers = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.send_to, group=self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.recv_from, group=self.group) for b in buffers]
        return dist.batch_isend_irecv(ops), buffers

    @staticmethod
    def received(pending: tuple[list[Any], list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        requests, buffers = pending
        for request in requests:
            request.wait()
        return tuple(buffers)


def _blocks(
    ring: _Ring, step: int, chunk_len: int, window: int | None
) -> Iterator[tuple[slice, slice, ChunkBlock]]:
    """Every (local query chunk, visiting key chunk) block of ring step ``step`` that sees a key.

    Yields the block's query rows in this rank's tensors, its key rows in the visiting ones, and the block.
    At step ``s`` the keys of rank ``r - s`` visit; every rank holds chunks ``j`` and ``2 * size - 1 - j``.
    """
    source = (ring.rank - step) % ring.size
    local = (ring.rank, 2 * ring.size - 1 - ring.rank)
    visiting = (source, 2 * ring.size - 1 - source)
    for q_place, a in enumerate(local):
        for k_place, b in enumerate(visiting):
            block = chunk_block(a, b, chunk_len, window)
            if block is None:
                continue
            q_start, k_start = q_place * chunk_len, k_place * chunk_len
            yield (
                slice(q_start + block.q_rows.start, q_start + block.q_rows.stop),
                slice(k_start + block.k_rows.start, k_start + block.k_rows.stop),
                block,
            )


def _window(block: ChunkBlock) -> tuple[bool, int, int]:
    """flash-attn's ``causal, window_size_left, window_size_right`` for ``block`` (a plain causal block as causal)."""
    if block.left < 0 and block.right == 0:
        return True, -1, -1
    return False, block.left, block.right


def _attention_options(scale: float, block: ChunkBlock) -> dict[str, Any]:
    """The flash-attn keywords a block's forward and backward share: its scale and its window."""
    causal, left, right = _window(block)
    return {
        "dropout_p": 0.0,
        "softmax_scale": scale,
        "causal": causal,
        "window_size_left": left,
        "window_size_right": right,
        "softcap": 0.0,
        "alibi_slopes": None,
    }


def _forward(kernel, q, k, v, scale, block: ChunkBlock) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = kernel(
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        return_softmax=False,
        **_attention_options(scale, block),
    )
    return out, lse


def _backward(kernel, dout, q, k, v, out, lse, scale, block: ChunkBlock) -> tuple[torch.Tensor, ...]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kernel(
        dout=dout.contiguous(),
        q=q,
        k=k,
        v=v,
        out=out.contiguous(),
        softmax_lse=lse.contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        deterministic=False,
        rng_state=None,
        **_attention_options(scale, block),
    )
    return dq, dk, dv
