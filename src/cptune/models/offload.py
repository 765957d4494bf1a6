"""Activation offloading: the inputs gradient checkpointing keeps live in host memory between forward and backward.

With gradient checkpointing, each decoder layer keeps only its input for the backward
(``layers x tokens x hidden`` values: 8 KiB per token per layer for Llama-3.1-8B in bf16,
the largest activation term at long context). :class:`ActivationOffloader` becomes each
layer's checkpoint function (the ``_gradient_checkpointing_func`` that transformers'
``GradientCheckpointingLayer`` calls): torch's non-reentrant checkpoint saves the layer's
positional inputs (its hidden states) through the saved-tensor hooks active when it is
called, and runs the layer under its own hooks, so only the checkpoint inputs pass
through ours -- not the tensors saved outside the layers (the loss, the final norm),
and not the intermediates the checkpoint recomputes.

On a GPU the copy to pinned host memory runs on a side stream after the compute that
made the tensor; in the backward, unpacking a layer's input also starts bringing back
the input of the layer before it on that stream, so the copy overlaps the recomputation
and backward of the current layer (two layers' inputs are on the GPU at a time). On CPU
the same code runs with no streams, copying into host buffers that are not allocated by
torch's CPU allocator -- the analogue of pinned memory, which the CUDA allocator does not
count either -- so the CPU memory benchmark sees what a GPU would. Either way the values
come back bit for bit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


@dataclass(eq=False)
class _Offloaded:
    """One checkpoint input held in host memory, and its copy on the way back, if started."""

    host: list[torch.Tensor]  # the flattened tensor in chunks (see PINNED_CHUNK_BYTES)
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    index: int
    ready: torch.Tensor | None = None
    copied: Any = None  # CUDA event: the copy back finished (None on CPU)
    consumed: bool = False


@dataclass
class OffloadStats:
    """What the offloader moved and holds (for tests, benchmarks and the memory model's checks)."""

    host_bytes: int = 0
    peak_host_bytes: int = 0
    packed: int = 0
    unpacked: int = 0
    prefetched: int = 0


class ActivationOffloader:
    """A checkpoint function that keeps each checkpoint's inputs in host memory until the backward.

    Args:
        use_streams: Copy on a CUDA side stream (default: when CUDA is available).
    """

    def __init__(self, use_streams: bool | None = None):
        self.use_streams = torch.cuda.is_available() if use_streams is None else use_streams
        self.stats = OffloadStats()
        self._stream = torch.cuda.Stream() if self.use_streams else None
        # Packed inputs in forward order, held weakly: autograd owns them (a graph that is freed
        # without a backward frees them too); a backward unpacks them newest first.
        self._live: list[weakref.ref[_Offloaded]] = []
        self._count = 0

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args)`` under non-reentrant checkpointing, its inputs offloaded."""
        if kwargs.setdefault("use_reentrant", False):
            raise ValueError("activation offloading composes with non-reentrant checkpointing only")
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return checkpoint(function, *args, **kwargs)

    def _pack(self, tensor: torch.Tensor) -> _Offloaded | torch.Tensor:
        if tensor.is_sparse or tensor.numel() == 0:
            return tensor
        pinned = self._stream is not None
        parts = tensor.detach().reshape(-1).split(PINNED_CHUNK_BYTES // tensor.element_size())
        host = [_host_buffer(part, pinned) for part in parts]
        with self._on_side_stream():
            for buffer, part in zip(host, parts, strict=True):
                buffer.copy_(part, non_blocking=pinned)
        if pinned:
            # The caching allocator must not hand the tensor's memory out before the copy has read it.
            tensor.record_stream(self._stream)
        entry = _Offloaded(host, tensor.shape, tensor.dtype, tensor.device, index=self._count)
        self._count += 1
        self._live = [ref for ref in self._live if ref() is not None]
        self._live.append(weakref.ref(entry))
        size = sum(_nbytes(buffer) for buffer in host)
        self.stats.packed += 1
        self.stats.host_bytes += size
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self.stats.host_bytes)
        weakref.finalize(entry, self._forget, size)
        return entry

    def _forget(self, size: int) -> None:
        self.stats.host_bytes -= size

    def _unpack(self, entry: _Offloaded | torch.Tensor) -> torch.Tensor:
        if isinstance(entry, torch.Tensor):
            return entry
        if entry.ready is None:
            self._bring_back(entry)
        entry.consumed = True
        # Start the copy of the input the backward needs next: the newest earlier one still on the host.
        for ref in reversed(self._live):
            earlier = ref()
            if earlier is not None and earlier.index < entry.index and not earlier.consumed:
                if earlier.ready is None:
                    self._bring_back(earlier)
                    self.stats.prefetched += 1
                break
        tensor, entry.ready = entry.ready, None
        if self._stream is not None:
            torch.cuda.current_stream().wait_event(entry.copied)
            tensor.record_stream(torch.cuda.current_stream())
        self.stats.unpacked += 1
        return tensor

    def _bring_back(self, entry: _Offloaded) -> None:
        with self._on_side_stream():
            ready = torch.empty(entry.shape, dtype=entry.dtype, device=entry.device)
            flat = ready.view(-1)
            start = 0
            for buffer in entry.host:
                flat.narrow(0, start, buffer.numel()).copy_(buffer, non_blocking=self._stream is not None)
                start += buffer.numel()
            entry.ready = ready
            if self._stream is not None:
                entry.copied = torch.cuda.Event()
                entry.copied.record(self._stream)

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        # The side stream first waits for the work queued so far (which made the tensor to copy).
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            yield


def enable_activation_offloading(model: torch.nn.Module) -> ActivationOffloader:
    """Make every checkpointed layer of ``model`` offload its inputs (gradient checkpointing must be on).

    transformers' checkpointed layers call their ``_gradient_checkpointing_func`` (set by
    ``gradient_checkpointing_enable``); it becomes the offloader for every layer that checkpoints.

    Raises:
        ValueError: no layer of the model checkpoints (enable gradient checkpointing first).
    """
    offloader = ActivationOffloader()
    layers = [
        m for m in model.modules() if getattr(m, "gradient_checkpointing", False) and hasattr(m, "forward")
    ]
    if not layers:
        raise ValueError(
            "activation offloading needs gradient checkpointing: no layer of the model checkpoints"
        )
    for module in layers:
        module._gradient_checkpointing_func = offloader
    return offloader


# Host memory is taken in chunks of this many bytes (a power of two): torch's pinned-memory allocator
# rounds every allocation up to a power of two (ATen/core/CachingHostAllocator.h), which would
# make a 2.6 GB layer input take 4 GiB of host RAM; in chunks only the last one is rounded.
PINNED_CHUNK_BYTES = 64 << 20


def _host_buffer(like: torch.Tensor, pinned: bool) -> torch.Tensor:
    if pinned:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
    # Memory from numpy, not torch's CPU allocator: like pinned memory on a GPU machine, it is host
    # memory that the device-side accounting (here torch's CPU allocator) does not count.
    import numpy as np

    raw = torch.from_numpy(np.empty(like.numel() * like.element_size(), dtype=np.uint8))
    return raw.view(like.dtype).view(like.shape)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
