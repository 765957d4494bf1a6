"""Measure memory and attention-kernel work inside one process.

**Tensor memory** (the primary method). With ``profile_memory=True`` torch's
profiler receives an event for every allocation and free that goes through
torch's CPU allocator (``c10::ProfiledCPUMemoryReporter``): every tensor storage,
including the scratch tensors kernels allocate internally. Replaying those events
in time order gives the exact number of bytes allocated since tracing began at
every moment, and so the peak. Blocks allocated before tracing are not counted
(their frees are ignored: :func:`traced_allocations`), so the peak is *above the
state at the start*: start with the model, gradients and optimizer state already
allocated and the peak is the step's activation memory.

The same trace splits the peak by where it happens: inside an attention kernel
(the ops named in :data:`KERNEL_OPS`, or calls wrapped by :class:`KernelClock`)
or elsewhere. ``kernel_workspace`` is the most any one kernel call held above what
was allocated when it started; ``peak_outside_kernels`` is the peak with each
kernel call counted only by what it leaves behind (its outputs).

**Resident memory** (a cross-check). ``/proc/self/clear_refs`` resets the
kernel's peak-RSS counter (``VmHWM``), so ``VmHWM - VmRSS`` read after a step that
began with a reset is how far that step pushed resident memory. Run with a fixed
``MALLOC_MMAP_THRESHOLD_`` so freed tensors go back to the kernel and RSS follows
live memory.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _ExtraFields_Allocation as _AllocationFields
from torch.profiler import ProfilerActivity, profile, record_function

KERNEL_LABEL = "cptune_bench::attention_kernel"
KERNEL_OPS = frozenset(
    {
        KERNEL_LABEL,
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_efficient_attention_backward",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_backward",
    }
)
"""Profiler event names that count as attention-kernel calls."""

# ring-flash-attn 0.1.8 binds flash-attn's kernels into these modules at import time.
RING_KERNEL_SITES = {
    "ring_flash_attn.llama3_flash_attn_varlen": ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"),
    "ring_flash_attn.zigzag_ring_flash_attn": ("_flash_attn_forward", "_flash_attn_backward"),
}


@dataclass(frozen=True)
class TraceResult:
    """Bytes allocated through torch's CPU allocator while a trace was active."""

    peak: int
    net: int
    kernel_workspace: int
    peak_outside_kernels: int


class AllocationTrace:
    """Context manager: the peak of torch CPU tensor memory allocated while it is active."""

    def __init__(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.result: TraceResult | None = None

    def __enter__(self) -> AllocationTrace:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profile.__exit__(*exc)
        if exc[0] is None:
            self.result = replay(*split_events(self._profile.profiler.kineto_results))


def split_events(result: Any) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(time, bytes) of CPU allocations (+) and frees (-) (:func:`traced_allocations`), and (start, end)
    of attention-kernel calls, from a profiler's results (``profile(...).profiler.kineto_results``)."""
    kernels = [(e.start_ns(), e.end_ns()) for e in result.events() if e.name() in KERNEL_OPS]
    return traced_allocations(result), kernels


def traced_allocations(result: Any) -> list[tuple[int, int]]:
    """(time, signed bytes) of the CPU allocations made while tracing, and of the frees of those blocks.

    The free of a block allocated before tracing began is left out. The profiler's own ``[memory]``
    events do not do that: torch's CPU reporter remembers the size of every block allocated while
    *any* memory profiling was on, so a block an earlier trace in the process allocated, freed during
    this one (a garbage collection, a cache dropped), showed up as a negative allocation and lowered
    the measured peak by its size. The profiler's allocation records carry the block's address, so
    each free is matched to an allocation seen in this trace.
    """
    records = []
    stack = list(reversed(result.experimental_event_tree()))
    while stack:  # in the tree's order (depth first, children in order), which breaks ties of time below
        node = stack.pop()
        stack.extend(reversed(node.children))
        fields = node.extra_fields
        if isinstance(fields, _AllocationFields) and fields.device.type == "cpu":
            records.append((node.start_time_ns, len(records), fields.ptr, fields.alloc_size))
    records.sort(key=lambda record: record[:2])
    live: dict[int, int] = {}
    memory = []
    for when, _, address, nbytes in records:
        if nbytes > 0:
            live[address] = nbytes
            memory.append((when, nbytes))
        elif live.pop(address, None) is not None:
            memory.append((when, nbytes))
    return memory


def replay(memory: list[tuple[int, int]], kernels: list[tuple[int, int]]) -> TraceResult:
    """Peak, net and the kernel split of a memory timeline (see the module docstring).

    Args:
        memory: (time, signed bytes) per allocation or free.
        kernels: (start, end) of every attention-kernel call; nested calls count as the outer one.
    """
    memory = sorted(memory, key=lambda event: event[0])
    intervals = _merge(sorted(kernels))
    level = peak = outside = workspace = 0
    k = 0
    inside_since: int | None = None  # the level when the current kernel call began
    inside_peak = 0
    for when, nbytes in memory:
        # Close every kernel call that ended before this event: count only what it left behind.
        while k < len(intervals) and intervals[k][1] < when:
            if inside_since is not None:
                workspace = max(workspace, inside_peak - inside_since)
                outside = max(outside, level)
                inside_since = None
            k += 1
        if inside_since is None and k < len(intervals) and intervals[k][0] <= when:
            inside_since, inside_peak = level, level
        level += nbytes
        peak = max(peak, level)
        if inside_since is None:
            outside = max(outside, level)
        else:
            inside_peak = max(inside_peak, level)
    if inside_since is not None:
        workspace = max(workspace, inside_peak - inside_since)
        outside = max(outside, level)
    return TraceResult(peak=peak, net=level, kernel_workspace=workspace, peak_outside_kernels=outside)


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS counter to its current RSS (Linux >= 4.0); False where impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of this process, in bytes (empty off Linux)."""
    values = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class KernelClock:
    """Thread CPU seconds and calls spent in ring-flash-attn's attention kernels in this process.

    :meth:`install` wraps the flash-attn kernels that ring-flash-attn imported
    (cptune's CPU stand-ins here, flash-attn's on a GPU machine): each call is
    timed with ``time.thread_time`` (CPU time, so a rank that waits for a CPU
    core or a peer is not charged for it) and marked for :class:`AllocationTrace`.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def install(self) -> None:
        """Wrap the kernels of every ring-flash-attn module imported so far (idempotent)."""
        for module_name, names in RING_KERNEL_SITES.items():
            module = sys.modules.get(module_name)
            if module is None:
                continue
            for name in names:
                original = getattr(module, name)
                if not getattr(original, "_cptune_bench_clock", False):
                    setattr(module, name, self._wrap(original))

    def _wrap(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(kernel)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with record_function(KERNEL_LABEL):
                started = time.thread_time()
                try:
                    return kernel(*args, **kwargs)
                finally:
                    self.seconds += time.thread_time() - started
                    self.calls += 1

        # ring-flash-attn reads the kernels' defaults with inspect.getfullargspec, which does
        # not follow __wrapped__ but does honour __signature__.
        timed.__signature__ = inspect.signature(kernel)  # type: ignore[attr-defined]
        timed._cptune_bench_clock = True  # type: ignore[attr-defined]
        return timed
