"""Parameters that DeepSpeed ZeRO-3 partitions: recognise them, and gather them for a computation.

ZeRO-3 keeps 1/world of each parameter on a rank. Its module hooks gather a module's parameters
before the module's forward (and again before its backward) and free them after, so between
module calls a parameter's ``data`` is an empty tensor. ZeRO-3 reduces a parameter's gradient
when its gradient accumulator runs (a post-accumulate-grad hook), which it expects once per
backward, while the parameter is whole. The memory features that call modules a second time in
the backward pass use these helpers where that matters:

* :mod:`cptune.models.tiled_mlp` sums a weight's gradient over the tiles and hands the sum to
  autograd once; for a partitioned weight it does so inside :func:`gathered`;
* the chunked head loss (:func:`cptune.parallel.loss.head_token_loss_sum`) recomputes each chunk
  (the final norm and the head) under non-reentrant checkpointing, which compares the recomputed
  saved tensors with the forward's; by then ZeRO-3 has freed the weights again, so for a norm or
  head with partitioned weights (:func:`any_partitioned`) that comparison is skipped (ZeRO-3's
  backward hooks gather the weights before they are used).

Without ZeRO-3 no parameter carries DeepSpeed's ``ds_id``: nothing changes, and DeepSpeed is
not imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def is_partitioned(param: torch.Tensor) -> bool:
    """DeepSpeed ZeRO-3 manages ``param`` (it marks its parameters with ``ds_id``)."""
    return hasattr(param, "ds_id")


def partitioned(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters among ``params`` that DeepSpeed ZeRO-3 partitions."""
    return [p for p in params if is_partitioned(p)]


def any_partitioned(module: Any) -> bool:
    """``module`` (an ``nn.Module``; any other callable has no parameters) has a ZeRO-3 partitioned parameter."""
    return isinstance(module, torch.nn.Module) and any(is_partitioned(p) for p in module.parameters())


def partition_group(module: Any) -> Any:
    """The process group over which ``module``'s first ZeRO-3 partitioned parameter is split (None: none is)."""
    if not isinstance(module, torch.nn.Module):
        return None
    for param in module.parameters():
        if is_partitioned(param):
            return getattr(param, "ds_process_group", None) or torch.distributed.group.WORLD
    return None


@contextlib.contextmanager
def gathered(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Hold ``params``' ZeRO-3 partitioned members whole inside the block (not modified); a no-op for the others.

    A parameter that is whole already is left as it is: a module whose backward is running holds it
    (ZeRO-3 gathered it for that backward and frees it after), and partitioning it at the block's end
    would take it from that module (DeepSpeed refuses: "Cannot free a ZeRO-3 parameter while it is
    still active in submodules"). So it is for a recomputed norm's trained weight
    (:mod:`cptune.models.recomputed_norms`), gathered for the norm's own backward.
    """
    zero3 = partitioned(params)
    if zero3:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        zero3 = [p for p in zero3 if p.ds_status != ZeroParamStatus.AVAILABLE]
    if not zero3:
        yield
        return
    from deepspeed.runtime.zero import GatheredParameters

    with GatheredParameters(zero3, modifier_rank=None):
        yield
