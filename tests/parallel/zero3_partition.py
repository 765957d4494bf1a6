"""Whether DeepSpeed ZeRO-3 really partitions a model's parameters (for the workers of ZeRO-3 runs).

ZeRO-3 marks every parameter it manages with ``ds_id``, but keeps whole on every rank those below
``stage3_param_persistence_threshold`` (1e5 elements by default: all of a tiny test model's), marking
them ``ds_persist``. A test that only looks for ``ds_id`` would pass on a run that partitions nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def whole_parameters(named: Iterable[tuple[str, torch.Tensor]], world_size: int) -> list[str]:
    """Names of the parameters ZeRO-3 does not split over ``world_size`` ranks (empty when it splits them all).

    A split parameter holds ``ceil(numel / world_size)`` of its ``ds_numel`` elements on each rank
    (``ds_tensor``, DeepSpeed's partition with its padding) and is not persistent.
    """
    whole = []
    for name, param in named:
        partitioned = (
            hasattr(param, "ds_id")
            and not param.ds_persist
            and param.ds_numel > 1
            and param.ds_tensor.numel() == -(-param.ds_numel // world_size) < param.ds_numel
        )
        if not partitioned:
            whole.append(name)
    return whole
