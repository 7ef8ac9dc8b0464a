"""Rank topology (DeepSpeed's ProcessTopology semantics) and ParallelDims, without processes."""
import pytest

from zerospeed.parallel import ParallelDims, PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology


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
