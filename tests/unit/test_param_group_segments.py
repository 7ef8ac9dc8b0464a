"""The per-group segment planner (`zero/param_groups.py`): pure, no processes."""
import pytest
import torch

from zerospeed.zero.param_groups import Segment, group_index, merge_segments, retarget
from zerospeed.zero.partition import plan_flat_partition


def test_one_group_gives_whole_sources_and_padding_only_sources_none():
    # two rows of width 10; row 1 holds elements only up to column 4 (then padding); a third is all padding
    pieces = [(0, 0, 6, 0), (0, 6, 10, 0), (1, 0, 4, 0)]
    assert merge_segments(pieces, [10, 10, 10]) == [Segment(0, 0, 10, 0), Segment(1, 0, 10, 0)]


def test_groups_split_a_source_where_they_change_and_tile_it_exactly():
    pieces = [(0, 0, 3, 0), (0, 3, 5, 1), (0, 5, 8, 1), (0, 8, 9, 0), (1, 0, 2, 1)]
    segs = merge_segments(pieces, [10, 10])
    assert segs == [Segment(0, 0, 3, 0), Segment(0, 3, 8, 1), Segment(0, 8, 10, 0), Segment(1, 0, 10, 1)]
    for s in (0, 1):  # the segments of a source cover [0, width) without gaps or overlaps
        cols = [c for g in segs if g.source == s for c in range(g.start, g.end)]
        assert cols == list(range(10))


def test_a_real_partition_every_fragment_lies_in_one_segment_of_its_group():
    numels = [7, 3, 12, 1, 9, 4]
    groups = [0, 1, 0, 1, 0, 1]
    layout = plan_flat_partition(numels, world_size=2, bucket_size=10)
    for rank in (0, 1):
        s = layout.shard_numel
        frags = layout.fragments(rank)
        segs = merge_segments(((f.chunk, f.partition_offset - f.chunk * s, f.partition_offset - f.chunk * s + f.numel,
                                groups[f.index]) for f in frags), [s] * layout.num_chunks)
        for f in frags:
            lo = f.partition_offset - f.chunk * s
            owner = [g for g in segs if g.source == f.chunk and g.start <= lo and lo + f.numel <= g.end]
            assert len(owner) == 1 and owner[0].group == groups[f.index]


def test_unordered_pieces_are_refused():
    with pytest.raises(ValueError, match="in order"):
        merge_segments([(0, 5, 8, 0), (0, 0, 3, 0)], [10])


def test_group_index_and_retarget_keep_the_users_groups():
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 3, 4))
    opt = torch.optim.AdamW([{"params": [a, c], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}])
    assert group_index(opt, [a, b, c], ["a", "b", "c"]) == [0, 1, 0]
    with pytest.raises(ValueError, match="in no optimizer param group"):
        group_index(opt, [a, b, c, torch.nn.Parameter(torch.zeros(1))], ["a", "b", "c", "d"])
    flat = torch.zeros(9)
    retarget(opt, [[flat[:6]], []])
    assert [len(g["params"]) for g in opt.param_groups] == [1, 0]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and not opt.state
