"""ZeRO-Infinity's parameter tier: each rank's ZeRO-3 parameter shards on NVMe between all-gathers.

ZeRO-Infinity, Rajbhandari et al. 2021, §5.1 and §6.2: a gather unit's shard (in the parameter
dtype) is read from its swap file into a buffer of a fixed pool just before the unit's all-gather,
and the buffer is returned as soon as the all-gather finishes; reads run ahead of use along the
order in which units were last requested (learned as a successor map, so forward and backward
orders are both followed). The shards change only at the optimizer step, which writes them back.
Up to `max_in_cpu` elements of shards (first units first) stay resident in host memory instead,
as DeepSpeed's `offload_param.max_in_cpu` does.
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
        self.live: dict[int, torch.Tensor] = {}   # read (or being read) into a pool buffer
        self.reads: dict[int, object] = {}
        self.writes: dict[int, tuple[object, torch.Tensor]] = {}
        self.users: dict[int, int] = {}
        self.successor: dict[int, int] = {}
        self.numel: dict[int, int] = {}
        self._last: int | None = None
        self.prefetch_depth = count - 2
        self.reads_done = 0  # number of shard reads issued (tests and benchmarks)
        self._extra: set[int] = set()  # storages of buffers allocated beyond the pool (freed on release)
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
        self.drain()
        return None

    def swapped(self, i: int) -> bool:
        return i in self.numel and i not in self.kept

    # -- use -------------------------------------------------------------------------------------
    def acquire(self, i: int) -> torch.Tensor:
        """Unit i's shard in host memory (read now if no prefetch brought it); start reads of the units
        expected next. Pair with release(i)."""
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
        self.users[i] = self.users.get(i, 0) + 1
        self._prefetch(i)
        return self.live[i]

    def release(self, i: int) -> None:
        """Done with unit i's shard (its all-gather finished): the buffer goes back to the pool."""
        if i in self.kept:
            return
        self.users[i] -= 1
        if not self.users[i]:
            del self.users[i]
            self._give_back(self.live.pop(i))

    def store(self, i: int, values: torch.Tensor) -> None:
        """Unit i's shard has new values (after an optimizer step or a modifier-rank edit): write them."""
        if i in self.kept:
            self.kept[i].copy_(values)
            return
        if i in self.live:  # a prefetched copy is now stale
            if self.users.get(i):  # in use right now (its read already waited): update it in place
                self.live[i].copy_(values)
            else:
                self._drop(i)
        self._wait_write(i)
        buf = self._take(self.numel[i])
        buf.copy_(values)
        self.writes[i] = (self.swap.write(self.key(i), buf), buf)

    def drain(self) -> None:
        """Wait for every write and return its buffer."""
        for i in list(self.writes):
            self._wait_write(i)

    def resident_bytes(self) -> int:
        """Host bytes: the buffer pool plus the shards kept resident."""
        return self.pool.nbytes + sum(t.numel() * t.element_size() for t in self.kept.values())

    # -- internals --------------------------------------------------------------------------------
    def _wait_write(self, i: int) -> None:
        entry = self.writes.pop(i, None)
        if entry is not None:
            entry[0].wait()
            self._give_back(entry[1])

    def _drop(self, i: int) -> None:
        handle = self.reads.pop(i, None)
        if handle is not None:
            handle.wait()
        self._give_back(self.live.pop(i))

    def _give_back(self, buf: torch.Tensor) -> None:
        ptr = buf.untyped_storage().data_ptr()
        if ptr in self._extra:
            self._extra.discard(ptr)  # freed with its last reference
        else:
            self.pool.release(buf)

    def _load(self, i: int) -> None:
        self._wait_write(i)
        buf = self._take(self.numel[i])
        self.live[i] = buf
        self.reads[i] = self.swap.read(self.key(i), buf)
        self.reads_done += 1

    def _take(self, n: int) -> torch.Tensor:
        """A pool buffer view of n elements; frees finished writes, then prefetched-but-unused shards.
        If every buffer holds a shard whose all-gather is still in flight (the stage-3 prefetch keeps
        more units gathering than `buffer_count`), a temporary buffer is allocated beyond the pool:
        that memory is bounded by the gathers in flight, whose full buffers are N times larger."""
        for i in [i for i, (h, _) in self.writes.items() if h.done()]:
            self._wait_write(i)
        if self.pool.free_count == 0:
            idle = [i for i in self.live if not self.users.get(i)]
            if idle:
                self._drop(idle[0])
            else:
                self.drain()
        if self.pool.free_count == 0:
            buf = aligned_empty(n, self.dtype)
            self._extra.add(buf.untyped_storage().data_ptr())
            self.extra_allocations += 1
            return buf
        return self.pool.acquire(n)

    def _prefetch(self, i: int) -> None:
        j = i
        for _ in range(self.prefetch_depth):
            j = self.successor.get(j)
            if j is None or j == i or self.pool.free_count <= 1:
                return
            if j not in self.kept and j not in self.live:
                self._load(j)
