"""cptune's collectives reach a process group on the device it communicates on.

A gloo group started as ``cuda:gloo`` takes CUDA tensors only and refuses a CPU
tensor with NCCL's own words ("No backend type associated with device type
cpu"), so on this CPU-only machine it stands in for the NCCL group of a GPU run:
every collective cptune issues must move its tensor to CUDA first. Without a GPU
that move fails with torch's "not compiled with CUDA" instead, which shows the
tensor was on its way to the right device (on a GPU the call succeeds). The
end-to-end runs check that nothing in cptune calls a collective past the helper
(tests/collective_audit.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from cptune.parallel.collectives import all_reduce_sum, group_device
from cptune.parallel.loss import step_target_count
from cptune.run.training.eval_loop import all_reduce_totals
from cptune.run.training.trainer import Throughput


@contextlib.contextmanager
def one_process_group(backend: str) -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("a process group was left open by an earlier test")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


CPTUNE_COLLECTIVES: dict[str, Callable[[], object]] = {
    "Throughput.rate": lambda: Throughput().rate(batch_group_size=1),
    "all_reduce_totals": lambda: all_reduce_totals(torch.tensor(2.0), torch.tensor(1)),
    "step_target_count": lambda: step_target_count(torch.tensor(4), copies=1),
    "all_reduce_sum": lambda: all_reduce_sum(torch.tensor(1)),
}


@pytest.mark.parametrize("name", CPTUNE_COLLECTIVES)
def test_a_cuda_only_group_gets_cuda_tensors(name):
    with one_process_group("cuda:gloo"):
        assert group_device() == torch.device("cuda")
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.tensor(1))  # what NCCL says to a CPU tensor, and what cptune once did
        if torch.cuda.is_available():
            CPTUNE_COLLECTIVES[name]()
        else:
            with pytest.raises((AssertionError, RuntimeError), match="not compiled with CUDA"):
                CPTUNE_COLLECTIVES[name]()


def test_groups_that_serve_the_cpu_get_cpu_tensors_and_the_sum_comes_back_where_it_was():
    with one_process_group("gloo"):
        assert group_device() == torch.device("cpu")
        total = all_reduce_sum(torch.tensor([1.5, 2.0], dtype=torch.float64))
        assert total.tolist() == [1.5, 2.0] and total.dtype == torch.float64
        throughput = Throughput()
        throughput.add(10)
        assert throughput.rate(batch_group_size=1) > 0
        assert step_target_count(torch.tensor(6), copies=2).item() == 3
    with one_process_group("cpu:gloo,cuda:gloo"):
        assert group_device() == torch.device("cpu")  # tiny tensors need no copy to the GPU
        assert all_reduce_totals(torch.tensor(6.0), torch.tensor(3)).metrics("eval")["eval_loss"] == 2.0


def test_without_a_process_group_the_sum_is_a_copy():
    value = torch.tensor(5)
    total = all_reduce_sum(value)
    assert total.item() == 5 and total is not value
