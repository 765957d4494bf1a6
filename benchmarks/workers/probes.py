"""The Trainer callbacks the rank workers measure with: :class:`StepProbe` (train_worker) and :class:`StateProbe` (state_worker).

Apart from the workers because importing transformers' ``TrainerCallback`` imports peft, and peft
imports bitsandbytes: a worker imports this module only after it has left bitsandbytes out for a
recipe that does not use it, as a rank of ``cptune train`` does
(:mod:`cptune.run.training.unused_imports`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import TrainerCallback

from benchmarks.memtrace import AllocationTrace, reset_peak_rss, rss_status


class StepProbe(TrainerCallback):
    """Times and measures each optimizer step, boundary to boundary."""

    def __init__(self, trace_step: int | None):
        self.trace_step = trace_step
        self.steps: list[dict[str, Any]] = []
        self.startup_peak_rss: int | None = None
        self._trace: AllocationTrace | None = None
        self._mark: tuple[float, float, int] | None = None

    def _begin_interval(self, next_step: int) -> None:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        reset_peak_rss()
        rss = rss_status().get("VmRSS", 0)
        if next_step == self.trace_step and not cuda:
            self._trace = AllocationTrace()
            self._trace.__enter__()
        self._mark = (time.perf_counter(), time.process_time(), rss)

    def on_train_begin(self, args, state, control, **kwargs):
        self.startup_peak_rss = rss_status().get("VmHWM")
        self._begin_interval(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        now, cpu = time.perf_counter(), time.process_time()
        status = rss_status()
        started, cpu_started, rss = self._mark
        record: dict[str, Any] = {
            "step": state.global_step,
            "seconds": now - started,
            "cpu_seconds": cpu - cpu_started,
            "rss_growth": status.get("VmHWM", 0) - rss,
            "peak_rss": status.get("VmHWM"),
        }
        if cuda:
            record["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            result = self._trace.result
            record["tensor_peak"] = result.peak
            self._trace = None
        self.steps.append(record)
        self._begin_interval(state.global_step + 1)


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (the local shard of a DTensor)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


class StateProbe(TrainerCallback):
    """Counts weights, gradients and optimizer state of this rank at every optimizer step."""

    def __init__(self) -> None:
        self.gradients = 0
        self.record: dict[str, Any] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.gradients = local_bytes(p.grad for p in model.parameters() if p.grad is not None)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        moments = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        self.record = {
            "step": state.global_step,
            "weights": local_bytes(model.parameters()),
            "gradients": self.gradients,
            "optimizer": local_bytes(moments),
            "model_parameters": sum(p.numel() for p in model.parameters()),
        }
