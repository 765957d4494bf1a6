"""Test-only: record every ``torch.distributed`` collective that cptune's own code calls.

Put this folder on ``PYTHONPATH`` and name a folder in ``CPTUNE_TEST_COLLECTIVE_AUDIT``
(``tests/collective_audit.py`` does both); every Python process of the run then wraps
torch.distributed's collectives at start-up. A call whose direct caller is a file of
the ``cptune`` package is written to ``<folder>/<pid>.jsonl``: where it came from,
whether it went through ``cptune/parallel/collectives.py``, and whether every tensor it
passed was on the device torch itself picks for the group
(``distributed_c10d._get_object_coll_device``). Calls from torch, accelerate, DeepSpeed
or ring-flash-attn are theirs and not recorded. Nothing happens without the variable.
"""

from __future__ import annotations

import os

FOLDER = os.environ.get("CPTUNE_TEST_COLLECTIVE_AUDIT")

# Collectives (and point-to-point calls) a caller passes tensors to, and those without tensors.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
)


def _install(folder: str) -> None:
    import functools
    import importlib.util
    import json
    import sys

    import torch
    import torch.distributed as dist

    spec = importlib.util.find_spec("cptune")
    if spec is None or not spec.submodule_search_locations:
        return
    package = os.path.realpath(spec.submodule_search_locations[0]) + os.sep
    parent = os.path.dirname(package.rstrip(os.sep)) + os.sep
    helper = os.path.join(package, "parallel", "collectives.py")
    out = os.path.join(folder, f"{os.getpid()}.jsonl")
    seen: set[tuple] = set()

    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from tensors(item)
        elif hasattr(value, "tensor") and isinstance(value.tensor, torch.Tensor):  # dist.P2POp
            yield value.tensor

    def where(frame) -> str:
        path = os.path.realpath(frame.f_code.co_filename)
        return f"{path[len(parent) :]}:{frame.f_code.co_name}"

    def wrap(name, original):
        @functools.wraps(original)
        def audited(*args, **kwargs):
            caller = sys._getframe(1)
            path = os.path.realpath(caller.f_code.co_filename)
            if path.startswith(package):
                group = kwargs.get("group")
                try:
                    expected = dist.distributed_c10d._get_object_coll_device(group)
                except Exception as err:  # no group: the call fails in the original below
                    expected = f"unknown ({err})"
                devices = sorted({t.device.type for t in tensors([*args, *kwargs.values()])})
                record = {
                    "collective": name,
                    "caller": where(caller),
                    "asked_by": where(caller.f_back) if caller.f_back is not None else None,
                    "through_helper": path == helper,
                    "devices": devices,
                    "group_device": expected,
                    "on_group_device": all(device == expected for device in devices),
                }
                key = tuple(str(v) for v in record.values())
                if key not in seen:
                    seen.add(key)
                    with open(out, "a") as f:
                        f.write(json.dumps(record) + "\n")
            return original(*args, **kwargs)

        return audited

    # Both names a caller can reach a collective by: torch.distributed.X and distributed_c10d.X.
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None:
            audited = wrap(name, original)
            setattr(dist, name, audited)
            if getattr(dist.distributed_c10d, name, None) is original:
                setattr(dist.distributed_c10d, name, audited)


if FOLDER:
    _install(FOLDER)
