"""The gloo patch (cptune/patches/torch_patches.py) against the installed torch: every gloo group gets one worker.

torch 2.13's gloo groups have 2 worker threads that write the group's status string outside its lock
(issue 26's heap corruption: ``devtools/gloo_status_race.py`` reproduces it, at random). What can be
checked every time is the cause's condition: the groups a run makes have one worker thread.
tests/run/test_train_e2e.py checks it of every group of a launched run.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from cptune.parallel.backends.table import BACKENDS
from cptune.patches import PatchSet, build_patch_set
from cptune.patches.torch_patches import gloo_one_worker_patch

TORCH = SimpleNamespace(context_parallel_size=2, cp_backend="torch", is_fsdp=False)


def one_rank_group_workers() -> tuple[int, timedelta]:
    """Start a one-rank gloo world, return its backend's worker threads and timeout, and end it."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=77)
    )
    try:
        options = c10d._get_default_group()._get_backend(torch.device("cpu")).options
        return options._threads, options._timeout
    finally:
        dist.destroy_process_group()


def test_torch_builds_gloo_groups_with_two_workers_and_the_patch_with_one():
    assert one_rank_group_workers() == (2, timedelta(seconds=77))  # the race's condition, unpatched
    original = c10d.ProcessGroupGloo
    with PatchSet([gloo_one_worker_patch()]).applied(None):
        assert one_rank_group_workers() == (1, timedelta(seconds=77))  # the caller's timeout kept
        group = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout=timedelta(seconds=5))
        assert isinstance(group, original)
        assert group.options._threads == 1 and len(group.options._devices) == 1
        options = original._Options()
        options._devices = [original.create_default_device()]
        options._threads = 4
        assert c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, options).options._threads == 1
    assert c10d.ProcessGroupGloo is original  # reverted


def test_the_patch_names_a_device_per_interface_in_gloo_socket_ifname(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")
    with PatchSet([gloo_one_worker_patch()]).applied(None):
        group = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1)
    assert len(group.options._devices) == 2 and group.options._threads == 1


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_backends_run_applies_it(backend):
    recipe = SimpleNamespace(**{**vars(TORCH), "cp_backend": backend})
    plan = build_patch_set(BACKENDS[backend], BACKENDS.values()).plan(recipe)
    assert "gloo-one-worker-thread" in [patch.name for patch in plan.selected]
