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

Two-level checkpointing (``activation_offloading: two_level``) halves the host memory: a layer
whose input is the output of a layer that was offloaded keeps nothing at all, and its backward
regenerates that input by running the layer before it again -- from the offloaded input, under
the autocast, grad mode and RNG state that layer's forward ran with, keeping nothing for a
backward (as the checkpoint's own forward ran it) -- so dropout draws the same masks and the
regenerated input is the one the forward made, bit for bit. Layers 0, 2, 4, ... are offloaded,
1, 3, 5, ... regenerated: ``ceil(layers / 2)`` inputs in host memory, for one more forward of
half the layers in the backward.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from cptune.models.autocast_state import AutocastState


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
    replay: _Replay | None = None  # how to run its layer again (two-level checkpointing)


@dataclass(frozen=True)
class _Replay:
    """What running a layer's forward again needs: the layer (its keyword arguments bound), and the
    autocast, grad mode and RNG states its forward ran under (the same states the checkpoint stashes)."""

    function: Callable[..., Any]
    autocast: AutocastState
    grad_enabled: bool
    cpu_rng: torch.Tensor
    device_type: str
    devices: list[int]
    device_rng: list[torch.Tensor]

    @classmethod
    def capture(cls, function: Callable[..., Any], tensor: torch.Tensor) -> _Replay:
        devices, states = get_device_states(tensor) if _device_initialized(tensor.device) else ([], [])
        return cls(
            function,
            AutocastState.capture(tensor.device),
            torch.is_grad_enabled(),
            torch.get_rng_state(),
            tensor.device.type,
            devices,
            states,
        )

    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output on ``hidden``, as its forward computed it; nothing kept for a backward."""
        with (
            torch.random.fork_rng(devices=self.devices, device_type=self.device_type),
            self.autocast.entered(),
            torch.set_grad_enabled(self.grad_enabled),
            torch.autograd.graph.saved_tensors_hooks(_discard, _never_unpacked),
        ):
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            return _first_tensor(self.function(hidden)).detach()


@dataclass(eq=False)
class _Regenerated:
    """A checkpoint input kept nowhere: the backward makes it again from the input of the layer before."""

    source: _Offloaded


@dataclass
class OffloadStats:
    """What the offloader moved and holds (for tests, benchmarks and the memory model's checks)."""

    host_bytes: int = 0
    peak_host_bytes: int = 0
    packed: int = 0
    unpacked: int = 0
    prefetched: int = 0
    regenerated: int = 0  # two-level: layer inputs made again in the backward instead of offloaded


class ActivationOffloader:
    """A checkpoint function that keeps each checkpoint's inputs in host memory until the backward.

    Args:
        use_streams: Copy on a CUDA side stream (default: when CUDA is available).
        two_level: Offload every second layer's input only and regenerate the others in the backward
            (two-level checkpointing: half the host memory, one more forward of half the layers).
    """

    def __init__(self, use_streams: bool | None = None, two_level: bool = False):
        self.use_streams = torch.cuda.is_available() if use_streams is None else use_streams
        self.two_level = two_level
        self.stats = OffloadStats()
        self._stream = torch.cuda.Stream() if self.use_streams else None
        # Packed inputs in forward order, held weakly: autograd owns them (a graph that is freed
        # without a backward frees them too); a backward unpacks them newest first.
        self._live: list[weakref.ref[_Offloaded]] = []
        self._count = 0
        # Two-level: the previous call's output and the entry of its offloaded input (with its replay),
        # and, during a call, the input to regenerate and the entry of the call that made it.
        self._previous: tuple[weakref.ref[torch.Tensor], weakref.ref[_Offloaded]] | None = None
        self._regenerate: tuple[torch.Tensor, _Offloaded] | None = None
        self._replay: tuple[Callable[..., Any], torch.Tensor] | None = None
        self._packed: _Offloaded | None = None

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args)`` under non-reentrant checkpointing, its inputs offloaded."""
        if kwargs.setdefault("use_reentrant", False):
            raise ValueError("activation offloading composes with non-reentrant checkpointing only")
        if not self.two_level:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return checkpoint(function, *args, **kwargs)
        return self._two_level_call(function, args, kwargs)

    def _two_level_call(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One layer under two-level checkpointing: its input regenerated if the layer before made it
        from an offloaded input, else offloaded with what a later regeneration needs to run it again."""
        source = self._source_of(args)
        hidden = args[0] if len(args) == 1 and isinstance(args[0], torch.Tensor) else None
        self._packed = None
        if source is not None:
            self._regenerate = (args[0], source)
        elif hidden is not None:
            # Only a layer called with its hidden states alone can be run again from them (other
            # positional tensors would have to be kept as well).
            self._replay = (functools.partial(function, **_function_kwargs(kwargs)), hidden)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                output = checkpoint(function, *args, **kwargs)
        finally:
            self._regenerate = self._replay = None
        made = _first_tensor(output)
        packed, self._packed = self._packed, None
        if source is None and packed is not None and packed.replay is not None and made is not None:
            self._previous = (weakref.ref(made), weakref.ref(packed))
        else:
            self._previous = None
        return output

    def _source_of(self, args: tuple) -> _Offloaded | None:
        """The offloaded entry of the layer before, when this call's input is that layer's output."""
        if self._previous is None or len(args) != 1 or not torch.is_grad_enabled():
            return None
        made, entry = self._previous[0](), self._previous[1]()
        return entry if made is not None and args[0] is made else None

    def _pack(self, tensor: torch.Tensor) -> _Offloaded | _Regenerated | torch.Tensor:
        if tensor.is_sparse or tensor.numel() == 0:
            return tensor
        if self._regenerate is not None and tensor is self._regenerate[0]:
            self.stats.packed += 1
            self.stats.regenerated += 1
            return _Regenerated(self._regenerate[1])
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
        if self._replay is not None and tensor is self._replay[1]:
            entry.replay = _Replay.capture(self._replay[0], tensor)
            self._packed = entry
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

    def _unpack(self, entry: _Offloaded | _Regenerated | torch.Tensor) -> torch.Tensor:
        if isinstance(entry, torch.Tensor):
            return entry
        if isinstance(entry, _Regenerated):
            return self._regenerated(entry.source)
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

    def _regenerated(self, source: _Offloaded) -> torch.Tensor:
        """The output of the layer whose offloaded input is ``source``, made again. The input comes back
        (or was prefetched) and stays on the device: that layer's own backward comes next and uses it."""
        if source.ready is None:
            self._bring_back(source)
        hidden = source.ready
        if self._stream is not None:
            torch.cuda.current_stream().wait_event(source.copied)
            hidden.record_stream(torch.cuda.current_stream())
        assert source.replay is not None
        self.stats.unpacked += 1
        return source.replay.run(hidden)

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


def enable_activation_offloading(model: torch.nn.Module, two_level: bool = False) -> ActivationOffloader:
    """Make every checkpointed layer of ``model`` offload its inputs (gradient checkpointing must be on).

    transformers' checkpointed layers call their ``_gradient_checkpointing_func`` (set by
    ``activation_checkpointing_enable``); it becomes the offloader for every layer that checkpoints.
    ``two_level``: offload every second layer's input and regenerate the others (see the module).

    Raises:
        ValueError: no layer of the model checkpoints (enable gradient checkpointing first).
    """
    offloader = ActivationOffloader(two_level=two_level)
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


def _function_kwargs(kwargs: dict) -> dict:
    """The keyword arguments of a checkpoint call that are the function's (not the checkpoint's own)."""
    return {k: v for k, v in kwargs.items() if k not in _CHECKPOINT_KEYWORDS}


_CHECKPOINT_KEYWORDS = frozenset(
    ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")
)


def _first_tensor(output: Any) -> torch.Tensor | None:
    """A layer's output hidden states: the output itself, or the first element of a tuple output."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _device_initialized(device: torch.device) -> bool:
    # As torch's checkpoint does: stash a device's RNG only where its runtime is up already.
    return device.type == "cuda" and torch.cuda.is_initialized()


def _discard(tensor: torch.Tensor) -> None:
    return None


def _never_unpacked(nothing: None) -> torch.Tensor:
    raise RuntimeError("a regenerated layer input keeps nothing for a backward")
