"""ZeRO-Infinity's parameter tier: each rank's ZeRO-3 parameter shards on NVMe between all-gathers.

ZeRO-Infinity, Rajbhandari et al. 2021, §5.1 and §6.2: a gather unit's shard (in the parameter
dtype) lives in a swap file and is read into a buffer of a fixed pool just before the unit's
all-gather; reads run ahead of use along the order in which units were last requested (learned as
a successor map, so forward and backward orders are both followed). The pool doubles as a cache:
a buffer keeps its shard after the all-gather until the buffer is needed for another one (least
recently used first), so a backward right after its forward, or a forward right after the step
that wrote the shard, reads nothing when the pool is large enough. Shards change only at the
optimizer step, which writes them through (asynchronously) from their buffer. Up to `max_in_cpu`
elements of shards (first units first) stay resident in host memory instead, as DeepSpeed's
`offload_param.max_in_cpu` does.
"""
from __future__ import annotations

import torch

from .aio import aligned_empty
from .swap import BufferPool, SwapSpace

__all__ = ["ParamSwapper"]


class ParamSwapper:
    """Parameter shards of gather units (keyed by unit index) in `swap`, read through a buffer pool.

    buffer_count / buffer_size: the pool (`offload_param.buffer_count` x `buffer_size` elements of
    `dtype`); a unit's shard must fit one buffer. max_in_cpu: elements kept resident instead.
    Raises ValueError (from the pool) when a shard is larger than buffer_size, naming both sizes.
    """

    def __init__(self, swap: SwapSpace, *, buffer_count: int, buffer_size: int, max_in_cpu: int,
                 dtype: torch.dtype, pin: bool = False):
        self.swap, self.dtype = swap, dtype
        count = max(buffer_count, 2)
        self.pool = BufferPool(count, buffer_size, dtype, pin=pin,
                               name="zero_optimization.offload_param.buffer_size")
        self.budget = max_in_cpu
        self.kept: dict[int, torch.Tensor] = {}   # resident for good (max_in_cpu)
        self.live: dict[int, torch.Tensor] = {}   # in a pool buffer (valid, or being read); LRU order
        self.reads: dict[int, object] = {}        # reads in flight into live buffers
        self.writes: dict[int, object] = {}       # writes in flight out of live buffers
        self.users: dict[int, int] = {}
        self.successor: dict[int, int] = {}
        self.numel: dict[int, int] = {}
        self._last: int | None = None
        self.prefetch_depth = count - 2
        self.reads_done = 0  # number of shard reads issued (tests and benchmarks)
        self._extra: set[int] = set()  # storages of buffers allocated beyond the pool (freed on eviction)
        self.extra_allocations = 0

    @staticmethod
    def key(i: int) -> str:
        return f"param_unit{i}"

    def add(self, i: int, values: torch.Tensor) -> torch.Tensor | None:
        """Take unit i's shard `values` (1-D, parameter dtype). Returns the resident tensor if it stays in
        host memory (max_in_cpu), else writes it to disk and returns None."""
        n = values.numel()
        self.numel[i] = n
        if n <= self.budget:
            self.budget -= n
            self.kept[i] = values
            return values
        self.store(i, values)
        self._evict(i)  # building: keep the pool free for the units still to come
        return None

    def swapped(self, i: int) -> bool:
        return i in self.numel and i not in self.kept

    # -- use -------------------------------------------------------------------------------------
    def acquire(self, i: int) -> torch.Tensor:
        """Unit i's shard in host memory (read now unless cached or prefetched); start reads of the
        units expected next. Pair with release(i)."""
        if i in self.kept:
            return self.kept[i]
        if self._last is not None and self._last != i:
            self.successor[self._last] = i
        self._last = i
        if i not in self.live:
            self._load(i)
        handle = self.reads.pop(i, None)
        if handle is not None:
            handle.wait()
        self.live[i] = self.live.pop(i)  # most recently used
        self.users[i] = self.users.get(i, 0) + 1
        self._prefetch(i)
        return self.live[i]

    def release(self, i: int) -> None:
        """Done with unit i's shard (its all-gather finished); a pool buffer stays a cached copy."""
        if i in self.kept:
            return
        self.users[i] -= 1
        if not self.users[i]:
            del self.users[i]
            if self.live[i].untyped_storage().data_ptr() in self._extra:  # never cache beyond the pool
                self._evict(i)

    def store(self, i: int, values: torch.Tensor) -> None:
        """Unit i's shard has new values (after an optimizer step or a modifier-rank edit): put them in
        its buffer (a cached copy stays valid) and start writing them to disk."""
        self.open_store(i).copy_(values)
        self.close_store(i)

    def open_store(self, i: int) -> torch.Tensor:
        """Unit i's buffer [numel], to be filled with its new values in place (a part at a time: the optimizer
        steps a shard tile by tile) before `close_store(i)` writes it out; `store` without a staging copy.
        Until then the buffer is in use: never evicted, never read into. A unit kept resident (max_in_cpu)
        returns its tensor itself. Do not gather the unit between the two calls."""
        if i in self.kept:
            return self.kept[i]
        self._wait_write(i)
        if i in self.live:
            handle = self.reads.pop(i, None)
            if handle is not None:  # a read of the old values still in flight into the buffer
                handle.wait()
        else:
            self.live[i] = self._take(self.numel[i])
        self.users[i] = self.users.get(i, 0) + 1
        return self.live[i]

    def close_store(self, i: int) -> None:
        """Unit i's buffer holds its new values (`open_store`): start writing them to disk; the buffer stays
        a cached copy."""
        if i in self.kept:
            return
        self.writes[i] = self.swap.write(self.key(i), self.live[i])
        self.release(i)

    def drain(self) -> None:
        """Wait for every write."""
        for i in list(self.writes):
            self._wait_write(i)

    def resident_bytes(self) -> int:
        """Host bytes: the buffer pool plus the shards kept resident."""
        return self.pool.nbytes + sum(t.numel() * t.element_size() for t in self.kept.values())

    # -- internals --------------------------------------------------------------------------------
    def _wait_write(self, i: int) -> None:
        handle = self.writes.pop(i, None)
        if handle is not None:
            handle.wait()

    def _evict(self, i: int) -> None:
        """Give unit i's buffer back (after its read and write are done); the shard stays on disk."""
        handle = self.reads.pop(i, None)
        if handle is not None:
            handle.wait()
        self._wait_write(i)
        buf = self.live.pop(i)
        ptr = buf.untyped_storage().data_ptr()
        if ptr in self._extra:
            self._extra.discard(ptr)  # freed with its last reference
        else:
            self.pool.release(buf)

    def _load(self, i: int, protect: frozenset = frozenset()) -> None:
        self._wait_write(i)
        buf = self._take(self.numel[i], protect)
        self.live[i] = buf
        self.reads[i] = self.swap.read(self.key(i), buf, urgent=True)  # the training thread waits for it soon
        self.reads_done += 1

    def _victim(self, protect) -> int | None:
        """The least recently used cached shard not in use and not in `protect`."""
        return next((j for j in self.live if not self.users.get(j) and j not in protect), None)

    def _take(self, n: int, protect: frozenset = frozenset()) -> torch.Tensor:
        """A buffer view of n elements: a free pool buffer, else the least recently used cached shard's
        (not in use, not in `protect`), else -- every buffer holds a shard whose all-gather is still in
        flight (the stage-3 prefetch keeps more units gathering than `buffer_count`) -- a temporary
        buffer beyond the pool, freed on eviction: that memory is bounded by the gathers in flight,
        whose full buffers are N times larger."""
        if self.pool.free_count == 0:
            victim = self._victim(protect)
            if victim is not None:
                self._evict(victim)
        if self.pool.free_count == 0:
            buf = aligned_empty(n, self.dtype)
            self._extra.add(buf.untyped_storage().data_ptr())
            self.extra_allocations += 1
            return buf
        return self.pool.acquire(n)

    def _prefetch(self, i: int) -> None:
        """Read ahead the next `prefetch_depth` units of the learned order, evicting only cached shards
        that are not among them (never allocating beyond the pool)."""
        chain, j = [], i
        for _ in range(self.prefetch_depth):
            j = self.successor.get(j)
            if j is None or j == i or j in chain:
                break
            chain.append(j)
        protect = frozenset(chain) | {i}
        for j in chain:
            if j in self.kept or j in self.live:
                continue
            if self.pool.free_count == 0 and self._victim(protect) is None:
                return
            self._load(j, protect)
