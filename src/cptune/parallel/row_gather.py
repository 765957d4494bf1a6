"""Rows of a (tokens, width) tensor gathered chunk by chunk, their gradients written into one buffer.

The chunked loss projects only the tokens that have a target. Selecting them with a boolean
index (``hidden[kept]``) copies every kept row at once, and its backward fills a zero tensor of
the whole sequence (besides the gradient of the copy, assembled from the chunks' by a ``cat``):
two full-size tensors the loss does not need. :class:`RowGather` instead gathers each chunk's
rows inside that chunk's checkpoint (``index_select``, recomputed in the backward, so no copy is
kept), and its backward writes each chunk's row gradients into one buffer of the source's shape,
zeros elsewhere, which becomes the source's gradient once every chunk's backward has run.

It is two autograd functions sharing that buffer: :class:`_Source` marks the source (its
backward, which autograd runs after those of all its users, the gathers, hands the buffer on)
and :class:`_Gather` selects rows (its backward writes them into the buffer and passes nothing
to the source itself). The values are exactly those of the boolean index: the same rows, and
the same gradient per row (a row's gradient copied into zeros, as the index's backward adds it
to zeros).
"""

from __future__ import annotations

from typing import Any

import torch


class RowGather:
    """Gather rows of one (tokens, width) tensor per chunk; see the module docstring.

    Pass :meth:`track`'s result (not the tensor itself) to the chunks, and take the rows with
    :meth:`rows` inside each chunk's computation. The object holds no tensor of the graph (only
    the gradient buffer while the backward fills it), so the graph frees as usual.
    """

    def __init__(self) -> None:
        self._shape: torch.Size | None = None
        self._grad: torch.Tensor | None = None

    def track(self, source: torch.Tensor) -> torch.Tensor:
        """``source`` as the chunks must receive it: its gradient is the buffer the gathers fill."""
        self._shape = source.shape
        return _Source.apply(source, self) if source.requires_grad else source

    def rows(self, source: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows of ``source`` (what :meth:`track` returned, as a chunk received it) at ``positions``."""
        if source.requires_grad:
            return _Gather.apply(source, positions, self)
        return source.index_select(0, positions)

    def _write(self, positions: torch.Tensor, grad: torch.Tensor) -> None:
        if self._grad is None:
            self._grad = grad.new_zeros(self._shape)
        self._grad.index_copy_(0, positions, grad)

    def _take(self) -> torch.Tensor | None:
        grad, self._grad = self._grad, None
        return grad


class _Source(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, owner: RowGather) -> torch.Tensor:
        ctx.owner = owner
        ctx.set_materialize_grads(False)  # its users pass no gradient: no zeros to make
        return source.view_as(source)

    @staticmethod
    def backward(ctx: Any, _unused: torch.Tensor | None):
        return ctx.owner._take(), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, positions: torch.Tensor, owner: RowGather) -> torch.Tensor:
        ctx.owner = owner
        ctx.save_for_backward(positions)
        return source.index_select(0, positions)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        ctx.owner._write(positions, grad)
        return None, None, None
