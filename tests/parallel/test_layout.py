import pytest

from cptune.errors import LaunchError
from cptune.parallel.layout import ParallelDims


def test_dims_split_world_with_cp_innermost():
    dims = ParallelDims(world_size=4, cp_size=2)
    assert dims.dp_size == 2
    assert [dims.cp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [dims.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert dims.cp_group_ranks(1) == [2, 3]


def test_cp_must_divide_world():
    with pytest.raises(
        LaunchError, match="context_parallel_size=2 does not divide the number of processes \\(3\\)"
    ):
        ParallelDims(world_size=3, cp_size=2)
