import pytest

from cptune.errors import LaunchError
from cptune.parallel.layout import ParallelDims


def test_dims_split_world_with_cp_innermost():
    dims = ParallelDims(world_size=4, cp_size=2)
    assert dims.dp_size == 2
    assert [dims.cp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [dims.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [r for r in range(4) if dims.dp_rank(r) == 1] == [2, 3]  # the CP group of dp rank 1


def test_cp_must_divide_world():
    with pytest.raises(
        LaunchError, match="context_parallel_size=2 does not divide the number of processes \\(3\\)"
    ):
        ParallelDims(world_size=3, cp_size=2)


def test_fsdp_layout_shards_over_dp_shard_times_cp():
    dims = ParallelDims(world_size=8, cp_size=2, dp_replicate_size=2, fsdp=True)
    assert (dims.dp_size, dims.dp_shard_size, dims.shard_group_size) == (4, 2, 4)
    assert dims.sharded
    assert dims.describe() == (
        "8 = 2 dp_replicate × 2 dp_shard × 2 cp; model states sharded (FSDP2) over 4 ranks (dp_shard × cp), "
        "replicated 2×"
    )
    # A single process has nothing to shard, unless FSDP2 is to keep the states in host memory.
    assert not ParallelDims(world_size=1, cp_size=1, fsdp=True).sharded
    alone = ParallelDims(world_size=1, cp_size=1, fsdp=True, offload_params=True)
    assert alone.sharded and alone.shard_group_size == 1
    assert not ParallelDims(world_size=1, cp_size=1, offload_params=True).sharded  # no FSDP2 asked for
    plain = ParallelDims(world_size=4, cp_size=2)
    assert plain.shard_group_size == 1 and not plain.sharded
    assert plain.describe() == "4 = 2 data-parallel × 2 context-parallel; model states whole on every rank"


def test_fsdp_layouts_that_cannot_work():
    with pytest.raises(
        LaunchError, match=r"dp_replicate_size=2 × context_parallel_size=2 = 4 does not divide"
    ):
        ParallelDims(world_size=6, cp_size=2, dp_replicate_size=2, fsdp=True)
    # accelerate refuses HSDP with CP when dp_shard is 1.
    with pytest.raises(LaunchError, match=r"leaves dp_shard_size at 1.*\(dp_shard_size ≥ 2: 8\)"):
        ParallelDims(world_size=4, cp_size=2, dp_replicate_size=2, fsdp=True)


def test_recipe_dp_shard_size_must_match_the_processes():
    from cptune.config.loader import validate_recipe

    recipe = validate_recipe(
        {
            "base_model": "m",
            "datasets": [{"path": "d"}],
            "fsdp_version": 2,
            "dp_shard_size": 2,
            "context_parallel_size": 2,
        }
    )
    assert ParallelDims.from_recipe(recipe, 4).dp_shard_size == 2
    with pytest.raises(LaunchError, match=r"dp_shard_size=2 needs .* = 4 processes, but 2 were asked for"):
        ParallelDims.from_recipe(recipe, 2)


def test_tensor_parallel_is_innermost_as_in_accelerates_mesh():
    import torch
    from accelerate import ParallelismConfig

    dims = ParallelDims(world_size=8, cp_size=2, fsdp=True, tp_size=2)
    assert (dims.dp_size, dims.dp_shard_size, dims.batch_group_size, dims.shard_group_size) == (2, 2, 4, 8)
    # accelerate's mesh (dp_shard, cp, tp): a rank's coordinates are those ParallelDims gives it.
    names, shape = ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2)._get_mesh()
    assert names == ("dp_shard", "cp", "tp")
    grid = torch.arange(8).reshape(shape)
    for rank in range(8):
        shard, cp, tp = (int(i) for i in (grid == rank).nonzero()[0])
        assert (dims.dp_rank(rank), dims.cp_rank(rank), rank % 2) == (shard, cp, tp)
    assert dims.describe() == (
        "8 = 2 dp_shard × 2 cp × 2 tp; model states sharded (FSDP2) over 4 ranks (dp_shard × cp), "
        "each weight first split over 2 tp ranks"
    )


def test_tensor_parallel_layouts_that_cannot_work():
    with pytest.raises(LaunchError, match="tensor_parallel_size applies only with fsdp_version: 2"):
        ParallelDims(world_size=4, cp_size=2, tp_size=2)
    with pytest.raises(
        LaunchError,
        match=r"context_parallel_size=2 × tensor_parallel_size=2 = 4 does not divide the number of processes \(6\)",
    ):
        ParallelDims(world_size=6, cp_size=2, fsdp=True, tp_size=2)
    # accelerate's FSDP2 needs a dp_shard × cp axis of 2 or more ranks to shard over.
    with pytest.raises(LaunchError, match=r"leaves FSDP2 no ranks to shard over .* Launch 4 processes"):
        ParallelDims(world_size=2, cp_size=1, fsdp=True, tp_size=2)


def test_recipe_process_count_includes_tensor_parallel_ranks():
    from cptune.config.loader import validate_recipe

    keys = {"base_model": "m", "datasets": [{"path": "d"}], "fsdp_version": 2, "context_parallel_size": 2}
    recipe = validate_recipe({**keys, "dp_shard_size": 2, "tensor_parallel_size": 2})
    assert recipe.default_process_count == 8
    assert ParallelDims.from_recipe(recipe, 8).tp_size == 2
    with pytest.raises(
        LaunchError, match=r"dp_shard_size=2 needs .* tensor_parallel_size = 8 processes, but 4"
    ):
        ParallelDims.from_recipe(recipe, 4)
    assert validate_recipe({**keys, "tensor_parallel_size": 2}).default_process_count == 4
