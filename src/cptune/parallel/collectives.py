"""The collectives cptune issues itself, on the device their process group communicates on.

A process group takes tensors on the devices its backend serves only: NCCL (and a
gloo group started as ``cuda:gloo``) refuses a CPU tensor with "No backend type
associated with device type cpu", gloo alone takes CPU tensors. cptune's own
collectives are small (token counts, loss sums), so where they were built does
not matter; what matters is that they reach the group on its device. Every
collective in ``src/cptune`` goes through this module (a test wraps
``torch.distributed`` during real runs of every backend and fails on any other
caller: ``tests/run/collective_audit.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a default process group exists (a launched run), False in a single process."""
    return dist.is_available() and dist.is_initialized()


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device ``group``'s collectives take tensors on.

    The CPU when the group's backends include one for it (gloo, also next to NCCL as
    ``cpu:gloo,cuda:nccl``): cptune's tensors are tiny and often on the CPU already.
    Otherwise the group's accelerator (NCCL: ``cuda``), as the current device of
    that type (``torch.device("cuda")`` resolves to it when a tensor is moved), which
    accelerate sets to the process's own GPU. The same rule torch uses for its object
    collectives (``distributed_c10d._get_object_coll_device``).
    """
    group = group if group is not None else dist.group.WORLD
    types = [device.type for device in group._device_types]
    if not types or "cpu" in types:
        return torch.device("cpu")
    return torch.device(types[0])


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The sum of ``tensor`` over ``group`` (the world by default), on ``tensor``'s device.

    A new tensor either way; in a single process, a copy. Every process of the group must call it.
    """
    if not is_distributed():
        return tensor.detach().clone()
    reduced = tensor.detach().to(group_device(group), copy=True)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    return reduced.to(tensor.device)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The elementwise maximum of ``tensor`` over ``group`` (the world by default), on ``tensor``'s device.

    A new tensor either way; in a single process, a copy. Every process of the group must call it.
    """
    if not is_distributed():
        return tensor.detach().clone()
    reduced = tensor.detach().to(group_device(group), copy=True)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced.to(tensor.device)


class _SumOverGroup(torch.autograd.Function):
    """Sum all-reduce whose backward sums the incoming gradients over the group too."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return all_reduce_sum(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(grad.contiguous(), ctx.group), None


def differentiable_all_reduce_sum(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The sum of ``tensor`` over ``group``, through which gradients flow back to every rank's part.

    Every rank of the group receives the total and may use it; the gradient reaching a rank's part is
    the sum over the group of the gradients reaching the total on each rank (the adjoint of a sum whose
    result every rank uses). So when each rank backpropagates a share of one loss computed from the
    total (cptune's preference loss: ``1/C`` of it on each of the ``C`` ranks), every part receives the
    loss's full gradient. In a single process, the tensor itself (a copy that keeps the graph).
    """
    if not is_distributed():
        return tensor.clone()
    return _SumOverGroup.apply(tensor, group)
