"""Partition math for ZeRO stages 1-2: pure functions over element counts, no tensors, no processes.

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
"""
from __future__ import annotations

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

        Over all ranks the fragments cover every parameter element exactly once.
        """
        out = []
        for c in range(self.num_chunks):
            s_start, s_end = self.shard_range(c, rank)
            for i in self.members(c):
                p_start, p_end = self.param_range(i)
                lo, hi = max(s_start, p_start), min(s_end, p_end)
                if lo < hi:
                    out.append(Fragment(i, c, lo, hi, lo - p_start, c * self.shard_numel + lo - s_start))
        return out

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the group of {self.world_size} ranks")


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
    if any(n < 0 for n in numels):
        raise ValueError(f"element counts must be >= 0, got {list(numels)}")
    total = sum(numels)
    if total == 0:
        raise ValueError("nothing to partition: the parameters have 0 elements in total")
    chunk = math.ceil(math.ceil(total / math.ceil(total / bucket_size)) / world_size) * world_size
    num_chunks = math.ceil(total / chunk)  # rounding up to world_size may make the last chunk unneeded
    starts, offset = [], 0
    for n in numels:
        starts.append(offset)
        offset += n
    return FlatPartition(tuple(numels), tuple(starts), world_size, num_chunks, chunk)
