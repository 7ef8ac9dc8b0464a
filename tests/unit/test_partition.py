"""The ZeRO layout planner (`zero/partition.py`): stage 0's bucket plan, stages 1-2's chunked partition,
stage 3's one-chunk unit layout: sizes, padding, ownership, fragments."""
import pytest

from zerospeed.zero.partition import plan_buckets, plan_flat_partition, plan_one_chunk

NUMELS = [10, 3, 0, 40]  # 53 elements, one empty parameter


@pytest.mark.parametrize("world, bucket, chunks, chunk_numel, padding", [
    (2, 100, 1, 54, 1),   # one chunk: 53 -> 54
    (4, 100, 1, 56, 3),   # 53 -> 56
    (4, 20, 3, 20, 7),    # ceil(53/20) = 3 chunks of ceil(18/4)*4 = 20
    (2, 5, 9, 6, 1),      # 11 chunks of 5 round to 6 -> 9 chunks suffice
    (4, 1, 14, 4, 3),     # bucket below N: chunks of N elements, no chunk of pure padding
    (3, 53, 1, 54, 1),    # odd world size
])
def test_layout_sizes(world, bucket, chunks, chunk_numel, padding):
    lay = plan_flat_partition(NUMELS, world, bucket)
    assert (lay.num_chunks, lay.chunk_numel, lay.padding) == (chunks, chunk_numel, padding)
    assert lay.numel == 53 and lay.padded_numel == 53 + padding
    assert lay.chunk_numel % world == 0 and lay.chunk_numel <= max(bucket, 1) + world - 1
    assert padding < lay.chunk_numel and padding < chunks * world  # never a whole chunk of padding
    assert lay.partition_numel * world == lay.padded_numel
    assert lay.starts == (0, 10, 13, 13)


@pytest.mark.parametrize("world, bucket", [(1, 100), (2, 100), (4, 100), (2, 7), (4, 20), (4, 1), (3, 11)])
def test_shards_tile_the_buffer_and_fragments_cover_every_element_once(world, bucket):
    lay = plan_flat_partition(NUMELS, world, bucket)
    owner = [None] * lay.padded_numel
    for r in range(world):
        ranges = lay.rank_ranges(r)
        assert len(ranges) == lay.num_chunks and all(e - s == lay.shard_numel for s, e in ranges)
        for s, e in ranges:
            for x in range(s, e):
                assert owner[x] is None
                owner[x] = r
    assert None not in owner
    seen = {}
    for r in range(world):
        frags = lay.fragments(r)
        for f in frags:
            assert owner[f.flat_start] == owner[f.flat_end - 1] == r
            p_start, p_end = lay.param_range(f.index)
            assert p_start <= f.flat_start < f.flat_end <= p_end
            assert f.param_offset == f.flat_start - p_start
            # partition offset: position in this rank's [num_chunks, shard_numel] partition, row-major
            s_start, _ = lay.shard_range(f.chunk, r)
            assert f.partition_offset == f.chunk * lay.shard_numel + f.flat_start - s_start
            for x in range(f.flat_start, f.flat_end):
                assert x not in seen
                seen[x] = f.index
        assert sum(f.numel for f in frags) <= lay.partition_numel
    assert sorted(seen) == list(range(53))  # every parameter element once; padding (53..) in none


def test_members_chunks_and_launch_order():
    lay = plan_flat_partition(NUMELS, 4, 20)  # chunks [0,20) [20,40) [40,60)
    assert [lay.chunks_of(i) for i in range(4)] == [range(0, 1), range(0, 1), range(0), range(0, 3)]
    assert [lay.members(c) for c in range(3)] == [[0, 1, 3], [3], [3]]
    assert lay.launch_order() == [2, 1, 0]  # last parameters first: backward order
    assert lay.shard_range(1, 2) == (30, 35)
    assert lay.rank_ranges(3) == [(15, 20), (35, 40), (55, 60)]


def test_partition_is_a_regular_strided_view():
    """Rank r's partition is flat.view(K, L)[:, r*S:(r+1)*S]: same elements as its ranges, in order."""
    torch = pytest.importorskip("torch")
    lay = plan_flat_partition(NUMELS, 4, 20)
    flat = torch.arange(lay.padded_numel)
    S = lay.shard_numel
    for r in range(4):
        view = flat.view(lay.num_chunks, lay.chunk_numel)[:, r * S:(r + 1) * S].reshape(-1)
        expect = torch.cat([flat[s:e] for s, e in lay.rank_ranges(r)])
        assert torch.equal(view, expect)


@pytest.mark.parametrize("numels, world, bucket, match", [
    ([1], 0, 10, "world_size"), ([1], 2, 0, "bucket_size"), ([-1, 3], 2, 10, ">= 0"), ([0, 0], 2, 10, "0 elements"),
])
def test_bad_arguments(numels, world, bucket, match):
    with pytest.raises(ValueError, match=match):
        plan_flat_partition(numels, world, bucket)
    with pytest.raises(ValueError, match="outside the group"):
        plan_flat_partition([5], 2, 10).shard_range(0, 2)


def test_one_chunk_layout_padding_and_shard_ranges():
    """Stage 3's unit layout: one chunk padded to a multiple of N, one contiguous range per rank."""
    lay = plan_one_chunk([3, 4], 4)
    assert (lay.numel, lay.padded_numel, lay.shard_numel, lay.padding, lay.num_chunks) == (7, 8, 2, 1, 1)
    assert lay.starts == (0, 3)
    assert [lay.rank_range(r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert lay.param_shard_range(0, 0) == (0, 2) and lay.param_shard_range(0, 1) == (2, 3)
    assert lay.param_shard_range(1, 1) == (0, 1) and lay.param_shard_range(1, 3) == (3, 4)
    assert lay.param_shard_range(0, 3) == (0, 0)  # rank 3 holds none of parameter 0
    assert plan_one_chunk([5], 1).padded_numel == 5
    for numels, world in (([119104], 4), ([10, 1, 7], 3), ([1], 8), (NUMELS, 4)):
        lay = plan_one_chunk(numels, world)
        assert lay.padded_numel % world == 0 and 0 <= lay.padding < world
        assert lay.rank_ranges(1) == [lay.rank_range(1)]
        held = sum(hi - lo for r in range(world) for i in range(len(numels))
                   for lo, hi in [lay.param_shard_range(i, r)])
        assert held == sum(numels)  # every element on exactly one rank
        frags = [(f.index, f.param_offset, f.param_offset + f.numel) for r in range(world) for f in lay.fragments(r)]
        assert sorted(frags) == sorted((i, *lay.param_shard_range(i, r)) for r in range(world)
                                       for i in range(len(numels)) if lay.param_shard_range(i, r)[1])
    with pytest.raises(ValueError, match="world_size"):
        plan_one_chunk([1], 0)
    with pytest.raises(ValueError, match="rank_ranges"):
        plan_flat_partition(NUMELS, 4, 20).rank_range(0)


def test_one_chunk_layout_of_an_empty_unit():
    """A stage-3 unit without parameters (or with 0-element ones) plans 0 elements and no fragments."""
    for numels in ([], [0, 0]):
        lay = plan_one_chunk(numels, 3)
        assert (lay.numel, lay.padded_numel, lay.shard_numel, lay.padding) == (0, 0, 0, 0)
        assert [lay.rank_range(r) for r in range(3)] == [(0, 0)] * 3 and lay.fragments(2) == []
        assert all(lay.param_shard_range(i, r) == (0, 0) for i in range(len(numels)) for r in range(3))


def test_bucket_plan_reverse_order_and_size_limit():
    plan = plan_buckets([5, 3, 4, 2], 6)  # backward order: 2, 4 | 3 | 5
    assert plan.sizes == (6, 3, 5)
    assert [(s.index, s.bucket, s.offset) for s in plan.slots] == [(3, 0, 0), (2, 0, 2), (1, 1, 0), (0, 2, 0)]


def test_bucket_plan_parameter_larger_than_bucket_gets_its_own():
    assert plan_buckets([10, 1, 1], 4).sizes == (2, 10)
    with pytest.raises(ValueError, match="bucket_size"):
        plan_buckets([1, 2], 0)
