"""A process group that runs several ranks on one GPU: gloo underneath, CUDA tensors staged through host memory.

NCCL refuses two ranks on one device, and gloo's own collectives reject CUDA tensors for
point-to-point (``send``/``recv``, which ring-flash-attn's zigzag ring uses through
``batch_isend_irecv``) and, depending on the torch version, for the ``*_tensor`` collectives
the llama3 path and Ulysses use. This group takes any tensor: it copies it to host memory, runs
gloo's CPU operation there and copies the result back, synchronously. That makes the real
multi-rank code (ring-flash-attn, the trainer's all-reduces) run with cp=2 or cp=4 on a single
GPU for parity checks; it says nothing about communication speed.

``register()`` adds it as torch.distributed backend ``staged_gloo``: ``init_process_group
("staged_gloo", ...)`` and every ``new_group`` after it then use it. A Python ``ProcessGroup``
is not ``ProcessGroup`` itself, so ``batch_isend_irecv`` issues each ``isend``/``irecv`` on its
own (torch/distributed/distributed_c10d.py, ``batch_isend_irecv``); sends are asynchronous and
receives block, which cannot deadlock as long as every rank posts its sends of a batch before
its receives, as ring-flash-attn's ``RingComm`` does. Used by :mod:`benchmarks.gpu.multirank`
and tested on CPU by tests/parallel/kernel_tests/test_ring_cpu_distributed.py.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "staged_gloo"


def _done(result: Any) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy (always a copy, so the copy back is exercised on CPU too)."""
    return tensor.detach().to("cpu", copy=True)


class StagedGlooGroup(dist.ProcessGroup):
    """gloo on host copies of the tensors, results copied back; see the module docstring."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return BACKEND

    def size(self) -> int:
        return self._gloo.size()

    def rank(self) -> int:
        return self._gloo.rank()

    def allreduce(self, tensors, opts=None):
        host = [_host(t) for t in tensors]
        self._gloo.allreduce(host, opts or dist.AllreduceOptions()).wait()
        for tensor, copy in zip(tensors, host, strict=True):
            tensor.copy_(copy)
        return _done(tensors)

    def broadcast(self, tensors, opts=None):
        host = [_host(t) for t in tensors]
        self._gloo.broadcast(host, opts or dist.BroadcastOptions()).wait()
        for tensor, copy in zip(tensors, host, strict=True):
            tensor.copy_(copy)
        return _done(tensors)

    def allgather(self, output_lists, inputs, opts=None):
        host_out = [[_host(t) for t in outputs] for outputs in output_lists]
        self._gloo.allgather(host_out, [_host(t) for t in inputs], opts or dist.AllgatherOptions()).wait()
        for outputs, copies in zip(output_lists, host_out, strict=True):
            for tensor, copy in zip(outputs, copies, strict=True):
                tensor.copy_(copy)
        return _done(output_lists)

    def _allgather_base(self, output, input, opts=None):
        # As a list all-gather into the chunks: that one takes CPU tensors in every torch version.
        chunks = list(_host(output).chunk(self.size()))
        self._gloo.allgather([chunks], [_host(input)], opts or dist.AllgatherOptions()).wait()
        output.copy_(torch.cat(chunks).view_as(output))
        return _done(output)

    def _reduce_scatter_base(self, output, input, opts=None):
        # As an all-reduce of the whole input, keeping this rank's slice: more traffic, same sums.
        whole = _host(input)
        options = dist.AllreduceOptions()
        options.reduceOp = (opts or dist.ReduceScatterOptions()).reduceOp
        self._gloo.allreduce([whole], options).wait()
        output.copy_(whole.chunk(self.size())[self.rank()].view_as(output))
        return _done(output)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        host_out = _host(output)
        self._gloo.alltoall_base(
            host_out, _host(input), output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions()
        ).wait()
        output.copy_(host_out)
        return _done(output)

    # torch 2.13 calls these names (distributed_c10d.py all_gather_into_tensor, reduce_scatter_tensor,
    # all_to_all_single); torch 2.11 the underscored ones above.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        self._gloo.barrier(opts or dist.BarrierOptions()).wait()
        return _done(None)

    def send(self, tensors, dst, tag=0):
        # gloo keeps the host copy alive until the send completes; waiting on it waits for that.
        return self._gloo.send([_host(t) for t in tensors], dst, tag)

    def recv(self, tensors, src, tag=0):
        host = [_host(t) for t in tensors]
        self._gloo.recv(host, src, tag).wait()
        for tensor, copy in zip(tensors, host, strict=True):
            tensor.copy_(copy)
        return _done(tensors)


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> StagedGlooGroup:
    return StagedGlooGroup(store, rank, size, timeout)


def register() -> str:
    """Register the backend (once per process) and return its name."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    return BACKEND
