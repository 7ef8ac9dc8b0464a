"""Rank topology (DeepSpeed's ProcessTopology semantics) and ParallelDims, without processes."""
import pytest

from zerospeed.parallel import ParallelDims, PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from zerospeed.parallel.topology import expert_rank_lists


def test_pipe_model_data_order_matches_deepspeed():
    # DeepSpeed: axes [pipe, data, model], model innermost
    t = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert t.get_axis_names() == ["pipe", "data", "model"]
    assert [tuple(t.get_coord(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert t.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.get_axis_comm_lists("expert") == []
    assert t.filter_match(pipe=0, data=1) == [2, 3]
    assert t.get_axis_list("model", 1) == [1, 3, 5, 7]
    assert t.get_rank_repr(3) == "model_01"
    assert t.get_dim("data") == 2 and t.get_dim("expert") == 0 and t.world_size() == 8


def test_rank_coord_roundtrip_uneven():
    t = ProcessTopology(axes=["a", "b", "c"], dims=[3, 1, 4])
    for r in range(12):
        c = t.get_coord(r)
        assert t.get_rank(**c._asdict()) == r
    # every axis's comm lists partition the ranks
    for axis in "abc":
        flat = sorted(r for lst in t.get_axis_comm_lists(axis) for r in lst)
        assert flat == list(range(12))
    assert PipeDataParallelTopology(2, 3).get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]


def test_topology_errors():
    t = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    with pytest.raises(ValueError, match="filter_match"):
        t.get_rank(x=0)
    with pytest.raises(ValueError, match="outside"):
        t.get_rank(x=0, y=3)
    with pytest.raises(ValueError, match="not found"):
        t.get_coord(6)
    with pytest.raises(ValueError, match="dims"):
        ProcessTopology(axes=["x"], dims=[2, 2])
    with pytest.raises(ValueError, match=">= 1"):
        ProcessTopology(axes=["x"], dims=[0])


def test_parallel_dims():
    assert ParallelDims(tp=2).resolve(8) == ParallelDims(dp=4, tp=2, pp=1)
    assert ParallelDims(tp=2, pp=2).resolve(4) == ParallelDims(dp=1, tp=2, pp=2)
    with pytest.raises(ValueError, match="not divisible by tensor x pipeline parallel size 3 x 1"):
        ParallelDims(tp=3).resolve(4)
    with pytest.raises(ValueError, match="use dp=2"):
        ParallelDims(dp=3, tp=2).resolve(4)
    with pytest.raises(ValueError, match=">= 1"):
        ParallelDims(tp=0).resolve(4)


def test_expert_rank_lists_match_deepspeed():
    # DeepSpeed's _get_expert_parallel_ranks docstring: world 16, model 2, ep 4
    t = PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=8)
    expert, expert_data = expert_rank_lists(t, 4)
    assert expert == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert expert_data == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    # _create_expert_and_data_parallel's legacy example: world 16, no model parallelism, ep 2
    expert, expert_data = expert_rank_lists(PipeModelDataParallelTopology(1, 1, 16), 2)
    assert expert == [[2 * i, 2 * i + 1] for i in range(8)]
    assert expert_data == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    # world 4 = dp 4, ep 2 (tests/dist/test_mesh.py)
    assert expert_rank_lists(PipeModelDataParallelTopology(1, 1, 4), 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # pipeline stages carve their own: pp 2 x dp 2, ep 2
    assert expert_rank_lists(PipeModelDataParallelTopology(2, 1, 2), 2) == ([[0, 1], [2, 3]], [[0], [1], [2], [3]])
    # ep 1 and ep = dp: trivial expert groups and the data groups
    t = PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2)
    assert expert_rank_lists(t, 1) == ([[0], [2], [1], [3]], [[0, 2], [1, 3]])
    assert expert_rank_lists(t, 2) == ([[0, 2], [1, 3]], [[0], [2], [1], [3]])
    for ep in (1, 2, 4, 8):
        for lists in expert_rank_lists(PipeModelDataParallelTopology(2, 2, 8), ep):
            assert sorted(r for lst in lists for r in lst) == list(range(32))
    with pytest.raises(ValueError, match=r"ep=3 .* dp=8; choose ep among \[1, 2, 4, 8\]"):
        expert_rank_lists(PipeModelDataParallelTopology(1, 2, 8), 3)
    with pytest.raises(ValueError, match="no"):
        expert_rank_lists(ProcessTopology(["pipe"], [2]), 1)


def test_parallel_dims_expert():
    assert ParallelDims(ep=2).resolve(4) == ParallelDims(dp=4, tp=1, pp=1, ep=2)
    assert ParallelDims(ep=2).resolve(4).sizes() == {"data": 4, "tensor": 1, "pipe": 1, "model": 1, "expert": 2,
                                                     "expert_data": 2}
    with pytest.raises(ValueError, match="ep=3 does not divide the data-parallel size dp=2"):
        ParallelDims(tp=2, ep=3).resolve(4)
    with pytest.raises(ValueError, match="ep=0"):
        ParallelDims(ep=0).resolve(4)
