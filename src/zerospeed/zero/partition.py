"""The ZeRO layout planner: pure functions over element counts, no tensors, no processes.

Two plans, for every stage:
* `plan_buckets` (stage 0): whole parameters grouped into all-reduce buckets, in backward order.
* `FlatPartition` (stages 1-3): parameters flat, cut into equal chunks split over the ranks.
  `plan_flat_partition` plans stages 1-2's K bucket-sized chunks; `plan_one_chunk` plans one
  chunk (a stage-3 gather unit, stage 0's checkpoint slots), where each rank owns one contiguous
  range (`rank_range`, `param_shard_range`).

Stages 1-2 (`plan_flat_partition`):

All trainable parameters are laid out back to back, in registration order, in one flat buffer of
`padded_numel` elements. The buffer is cut into `num_chunks` equal chunks of `chunk_numel`
elements (a chunk boundary may cut through a parameter); each chunk is one communication bucket,
and its length is a multiple of the data-parallel world size N, so chunk b splits evenly into N
shards of `shard_numel` elements and rank r owns shard r of every chunk:

    flat:   | chunk 0                  | chunk 1                  | ... | chunk K-1 (+ padding) |
    chunk:  | shard 0 | shard 1 | ...  |                                                      |

A reduce-scatter of chunk b hands each rank exactly its shard, and an all-gather of the shards
rebuilds the chunk in place, one collective per chunk without copies (ZeRO, Rajbhandari et al.
2020, §5.1-5.2, with a bucketed rather than a single contiguous partition). Because every chunk
has the same length, rank r's partition is the regular strided view
`flat.view(num_chunks, chunk_numel)[:, r*shard_numel:(r+1)*shard_numel]`, shape
[num_chunks, shard_numel]: one tensor, no copy. Padding (< num_chunks * N elements) sits at the
end of the buffer and is always zero.

Chunks are launched in reverse (K-1 first), the order backward produces gradients in.

Stage 3 (`plan_one_chunk`): a unit's parameters flat, padded to a multiple of N (< N elements of
padding, none for an empty unit): the same layout with K = 1, so rank r owns the one range
[r*S, (r+1)*S) of the unit's flat vector (ZeRO §5.3, P_os+g+p).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Fragment:
    """The part of parameter `index` that lies in one rank's shard of chunk `chunk`.

    Flat elements [flat_start, flat_end) are elements [param_offset, param_offset + numel) of the
    flattened parameter and elements [partition_offset, partition_offset + numel) of the rank's
    partition flattened row-major (shape [num_chunks, shard_numel]).
    """

    index: int
    chunk: int
    flat_start: int
    flat_end: int
    param_offset: int
    partition_offset: int

    @property
    def numel(self) -> int:
        return self.flat_end - self.flat_start


@dataclass(frozen=True)
class FlatPartition:
    """Flat layout of parameters with element counts `numels`, split over `world_size` ranks.

    starts[i]: flat offset of parameter i. All sizes are in elements.
    """

    numels: tuple[int, ...]
    starts: tuple[int, ...]
    world_size: int
    num_chunks: int
    chunk_numel: int

    @property
    def numel(self) -> int:
        """Parameter elements (Ψ), without padding."""
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        """Elements of the flat buffer: num_chunks * chunk_numel >= numel."""
        return self.num_chunks * self.chunk_numel

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns of each chunk: chunk_numel / world_size."""
        return self.chunk_numel // self.world_size

    @property
    def partition_numel(self) -> int:
        """Elements one rank owns in total: padded_numel / world_size."""
        return self.num_chunks * self.shard_numel

    def param_range(self, index: int) -> tuple[int, int]:
        """Flat [start, end) of parameter `index`."""
        return self.starts[index], self.starts[index] + self.numels[index]

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """Flat [start, end) of chunk `chunk`."""
        return chunk * self.chunk_numel, (chunk + 1) * self.chunk_numel

    def shard_range(self, chunk: int, rank: int) -> tuple[int, int]:
        """Flat [start, end) of rank `rank`'s shard of chunk `chunk`."""
        self._check_rank(rank)
        start = chunk * self.chunk_numel + rank * self.shard_numel
        return start, start + self.shard_numel

    def rank_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Flat [start, end) ranges rank `rank` owns, one per chunk, in flat order."""
        return [self.shard_range(c, rank) for c in range(self.num_chunks)]

    def chunks_of(self, index: int) -> range:
        """The chunks parameter `index` has elements in (empty for a 0-element parameter)."""
        start, end = self.param_range(index)
        if end == start:
            return range(0)
        return range(start // self.chunk_numel, (end - 1) // self.chunk_numel + 1)

    def members(self, chunk: int) -> list[int]:
        """Parameters with elements in chunk `chunk`, in registration order."""
        return [i for i in range(len(self.numels)) if chunk in self.chunks_of(i)]

    def launch_order(self) -> list[int]:
        """Chunks in the order their reductions start: last chunk first (backward order)."""
        return list(range(self.num_chunks - 1, -1, -1))

    def fragments(self, rank: int) -> list[Fragment]:
        """Every piece of a parameter inside rank `rank`'s shards, in flat order.

        Over all ranks the fragments cover every parameter element exactly once. Computed once per
        (layout, rank): the layout is immutable, and the strategies walk these at every step.
        """
        return list(_fragments(self, rank))

    def _compute_fragments(self, rank: int) -> tuple[Fragment, ...]:
        out = []
        for c in range(self.num_chunks):
            s_start, s_end = self.shard_range(c, rank)
            for i in self.members(c):
                p_start, p_end = self.param_range(i)
                lo, hi = max(s_start, p_start), min(s_end, p_end)
                if lo < hi:
                    out.append(Fragment(i, c, lo, hi, lo - p_start, c * self.shard_numel + lo - s_start))
        return tuple(out)

    def rank_range(self, rank: int) -> tuple[int, int]:
        """Flat [start, end) of rank `rank`'s one shard. Only for a one-chunk layout (`plan_one_chunk`);
        raises ValueError for more chunks (a rank then owns one range per chunk: `rank_ranges`)."""
        if self.num_chunks != 1:
            raise ValueError(f"rank_range needs a one-chunk layout, this one has {self.num_chunks} chunks "
                             "(use rank_ranges)")
        return self.shard_range(0, rank)

    def param_shard_range(self, index: int, rank: int) -> tuple[int, int]:
        """[lo, hi) of parameter `index`'s flattened elements held by `rank`, (0, 0) if none. Only for a
        one-chunk layout (raises ValueError otherwise; see `fragments`)."""
        start, end = self.rank_range(rank)
        off, n = self.starts[index], self.numels[index]
        lo, hi = max(start, off) - off, min(end, off + n) - off
        return (lo, hi) if lo < hi else (0, 0)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the group of {self.world_size} ranks")


def _starts(numels) -> tuple[int, ...]:
    starts, offset = [], 0
    for n in numels:
        starts.append(offset)
        offset += n
    return tuple(starts)


def _check_counts(numels, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(n < 0 for n in numels):
        raise ValueError(f"element counts must be >= 0, got {list(numels)}")


def plan_one_chunk(numels: list[int] | tuple[int, ...], world_size: int) -> FlatPartition:
    """Pack parameters of `numels` elements back to back and pad to a multiple of `world_size`: one chunk
    of ceil(Ψ / N) * N elements (0 for no elements: an empty stage-3 unit), rank r owning
    [r*S, (r+1)*S). Raises ValueError for world_size < 1 or a negative count."""
    _check_counts(numels, world_size)
    total = sum(numels)
    return FlatPartition(tuple(numels), _starts(numels), world_size, 1, -(-total // world_size) * world_size)


@functools.lru_cache(maxsize=64)
def _fragments(layout: FlatPartition, rank: int) -> tuple[Fragment, ...]:
    return layout._compute_fragments(rank)


def plan_flat_partition(numels: list[int] | tuple[int, ...], world_size: int, bucket_size: int) -> FlatPartition:
    """Lay out parameters of `numels` elements flat and split them into chunks for `world_size` ranks.

    bucket_size: the largest chunk wanted, in elements (`reduce_bucket_size`, or the smaller of it and
    `allgather_bucket_size`). The number of chunks is K = ceil(Ψ / bucket_size) and each chunk holds
    ceil(Ψ / K) elements rounded up to a multiple of world_size, so a chunk may exceed bucket_size
    by at most world_size - 1 elements; padding is below both K * world_size and one chunk.
    Raises ValueError for world_size < 1, bucket_size < 1, a negative count or Ψ = 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
    _check_counts(numels, world_size)
    total = sum(numels)
    if total == 0:
        raise ValueError("nothing to partition: the parameters have 0 elements in total")
    chunk = math.ceil(math.ceil(total / math.ceil(total / bucket_size)) / world_size) * world_size
    num_chunks = math.ceil(total / chunk)  # rounding up to world_size may make the last chunk unneeded
    return FlatPartition(tuple(numels), _starts(numels), world_size, num_chunks, chunk)


# -- stage 0: whole parameters in all-reduce buckets ----------------------------------------------
@dataclass(frozen=True)
class BucketSlot:
    """Parameter `index` occupies elements [offset, offset + numel) of bucket `bucket`."""

    index: int
    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketPlan:
    """Buckets in launch order; `sizes[b]` is bucket b's length in elements."""

    slots: tuple[BucketSlot, ...]
    sizes: tuple[int, ...]

    def members(self, bucket: int) -> list[BucketSlot]:
        return [s for s in self.slots if s.bucket == bucket]


def plan_buckets(numels: list[int], bucket_size: int, *, reverse: bool = True) -> BucketPlan:
    """Group parameters (given by element counts, in module registration order) into buckets.

    Parameters are taken in reverse order by default, the order backward produces gradients in,
    so the first bucket fills first (as in PyTorch DDP, Li et al. 2020, §3.2.3). A parameter joins
    the open bucket unless that would take it past `bucket_size` elements; a parameter larger than
    `bucket_size` gets a bucket of its own. Raises ValueError if bucket_size < 1.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
    order = range(len(numels) - 1, -1, -1) if reverse else range(len(numels))
    slots: list[BucketSlot] = []
    sizes: list[int] = []
    fill = 0
    for i in order:
        n = numels[i]
        if fill and fill + n > bucket_size:
            sizes.append(fill)
            fill = 0
        slots.append(BucketSlot(i, len(sizes), fill, n))
        fill += n
    if fill or not sizes:
        sizes.append(fill)
    return BucketPlan(tuple(slots), tuple(sizes))
