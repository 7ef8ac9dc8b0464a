"""Give freed host memory back to the OS, so offload's RAM savings show up as a lower RSS.

glibc serves allocations below its mmap threshold from the heap and raises that threshold (up to
32 MiB) each time a larger mmapped block is freed; freeing the full-size copies of a model while
ZeRO-3 shards it, or gradient and I/O buffers of a few MiB per step, then leaves hundreds of MiB of
free-but-resident heap (measured here: 1.63 GB peak RSS instead of 1.06 GB for a 151M-parameter
GPT with NVMe offload at world size 2). Fixing the threshold at 1 MiB keeps every tensor-sized
block in its own mapping, returned to the OS when freed. No-op where the C library is not glibc.

The other side of that: a mapping made afresh is faulted in and zeroed by the kernel on first touch
(2 MiB at a time on huge pages: `clear_page_erms` took a third of all CPU samples of an in-memory
ZeRO-3 step at width 2048; bench/README.md, session 30). So the buffers a training step needs again
and again are handed out again instead: `RecycledBuffers` (per-step buffers, by byte size, reused once
nothing references them) and `GatheredPool` (ZeRO-3's full buffers, moved from the released unit to the
next one gathered), each bounded so that idle memory does not raise the peak it is measured against.
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["return_freed_memory_to_os", "advise_huge_pages", "collapse_huge_pages", "collapse_huge_range",
           "drop_file_pages", "trim_heap", "smaps_field",
           "RecycledBuffers", "recycled", "host_empty", "GatheredPool"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20
_MADV_DONTNEED = 4  # Linux
_MADV_HUGEPAGE = 14  # Linux
_MADV_COLLAPSE = 25  # Linux >= 6.1
HUGE_PAGE_BYTES = 2 << 20


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_madvise = None


def _libc_madvise():
    """libc's madvise (set up once), or False where there is none."""
    global _madvise
    if _madvise is None:
        libc = _libc()
        _madvise = getattr(libc, "madvise", False) if libc is not None else False
        if _madvise:
            _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _madvise


def _aligned(start: int, end: int) -> tuple[int, int]:
    """The 2 MiB-aligned [start, end) inside [start, end) (empty when it holds no whole huge page)."""
    return -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES


def _huge_range(tensor) -> tuple[int, int]:
    """The 2 MiB-aligned [start, end) inside `tensor`'s storage (empty when under 2 MiB); sets up madvise."""
    _libc_madvise()
    storage = tensor.untyped_storage()
    return _aligned(storage.data_ptr(), storage.data_ptr() + storage.nbytes())


def advise_huge_pages(tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of `tensor`'s storage (host memory, not yet touched) with
    transparent huge pages (madvise MADV_HUGEPAGE; what torch's THP_MEM_ALLOC_ENABLE does for every
    allocation, here only for the offload path's large buffers). A fresh 4 KiB-page buffer costs one page
    fault and a zeroed page per 4 KiB on first touch: measured here, filling a fresh 80 MB bf16 buffer took
    5.7x the time of filling a used one, 1.7x with huge pages (bench/README.md, session 19). Returns False
    where it does not apply (not Linux/glibc, under 2 MiB, THP disabled: nothing changes)."""
    lo, hi = _huge_range(tensor)
    if not _madvise or hi <= lo:
        return False
    return _madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


def collapse_huge_pages(tensor) -> bool:
    """Move the 2 MiB-aligned part of `tensor`'s storage (host memory already written: weights, a KV cache)
    onto transparent huge pages now, in place (madvise MADV_COLLAPSE, Linux >= 6.1): same addresses, same
    data. A tensor read whole again and again - a decode step's weights - then costs one TLB entry per 2 MiB
    instead of one page walk per 4 KiB: measured here, a frozen GEMV over the 154 MB lm_head of GPT-2 read
    1.11x faster (10 interleaved pairs, each faster; bench/README.md, session 26). Takes ~1.3 s per GB once.
    Returns False where it does not apply (not a CPU tensor, an opaque oneDNN tensor, under 2 MiB, a kernel
    before 6.1 or THP disabled, no glibc): nothing changes. Never raises for those."""
    if tensor.device.type != "cpu" or tensor.is_mkldnn:  # oneDNN's opaque tensors: no storage to reach
        return False
    try:
        lo, hi = _huge_range(tensor)
    except (RuntimeError, NotImplementedError):  # a tensor without storage data (fake, functional)
        return False
    return collapse_huge_range(lo, hi)


def collapse_huge_range(start: int, end: int) -> bool:
    """`collapse_huge_pages` for the 2 MiB-aligned part of an address range [start, end) of host memory this
    process mapped read-write (e.g. a block a library allocated: an AOTInductor package's constants). Returns
    False where it does not apply (no glibc, under 2 MiB, a kernel before 6.1, THP disabled)."""
    lo, hi = _aligned(start, end)
    madvise = _libc_madvise()
    if not madvise or hi <= lo:
        return False
    return madvise(lo, hi - lo, _MADV_COLLAPSE) == 0


def drop_file_pages(start: int, end: int) -> bool:
    """Drop this process's pages of [start, end), a file-backed mapping none of whose pages it has written
    (smaps "Anonymous: 0 kB"), from its resident set (madvise MADV_DONTNEED): the kernel reads them from the
    file again if they are ever touched, so nothing changes but the RSS. For the constants embedded in an
    AOTInductor library, copied out of it once when it is loaded. Returns False where it does not apply."""
    madvise = _libc_madvise()
    lo, hi = start // 4096 * 4096, end
    if not madvise or hi <= lo:
        return False
    return madvise(lo, hi - lo, _MADV_DONTNEED) == 0


def trim_heap() -> bool:
    """Give the free pages of glibc's heap back to the OS now (malloc_trim(0)): after a one-off burst of small
    allocations (an export and compilation: ~0.7 GB left resident for a 124M-parameter model, bench/README.md,
    session 36). Returns False where this is not glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def smaps_field(field: str) -> dict[int, int]:
    """{start address: bytes} of one /proc/self/smaps field ("Rss", "Anonymous", "AnonHugePages", ...) for every
    mapping of this process; {} where smaps is missing."""
    out, start = {}, None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):
                    start = int(head.split("-")[0], 16)
                elif head == field + ":" and start is not None:
                    out[start] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    return out


def return_freed_memory_to_os(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Process-wide: mmap every allocation of `threshold` bytes or more, and release free heap pages
    now (malloc_trim). Returns False where this is not glibc (nothing changed)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    trim_heap()
    return ok


class RecycledBuffers:
    """Host buffers of the offload data path handed out again instead of freed and re-allocated.

    A transient host buffer of tens of MB (a unit's reduce-scatter bucket, its fp32 gradient, the staging
    of a 2-byte gradient read back from disk) that is allocated afresh every step is a new mapping (the 1 MiB mmap
    threshold above): the kernel zeroes each of its pages on first touch, which costs more than the copy
    that fills it (measured here: filling a fresh 160 MB fp32 buffer from bf16 takes 4.8x the time of
    filling a used one; `bench/README.md`, session 19). This cache keeps the storages of finished buffers
    and hands one out again for a request of the same byte size. A storage is free when nothing but the
    cache references it (every tensor viewing it is gone: `torch._C._storage_Use_Count`), so a buffer still
    read by an I/O request or a collective is never handed out twice.

    max_idle_bytes: free storages kept at most (least recently used dropped first); per_size: free
    storages kept per byte size, or None: as many of a size as were ever in use at once, less those in use
    now (a size's storages never hold more than at that size's own peak). max_idle_bytes=None bounds the
    cache by its own peak instead: free storages are kept while the bytes it holds (in use + free) stay
    within the most bytes of its storages ever in use at once (`high`, measured at each `empty`), whatever
    their sizes, so a set of buffers that is all alive at some point of a step (a ZeRO-3 rank's gradient
    shards) is reused whole in the next step without raising the cache's peak. `before_fresh`: callables run
    before a new storage is allocated (`GatheredPool.watch`). Thread-safe. Without the use-count hook
    (another torch) nothing is kept.
    """

    def __init__(self, max_idle_bytes: int | None, per_size: int | None = 1):
        import threading

        import torch

        self._torch, self._lock = torch, threading.Lock()
        self.peak_bound = max_idle_bytes is None
        self.max_idle_bytes = 1 << 62 if self.peak_bound else int(max_idle_bytes)
        self.size_peak = per_size is None and not self.peak_bound
        self.per_size = 1 << 30 if self.peak_bound or per_size is None else int(per_size)
        self._size_high: dict[int, int] = {}  # size_peak: byte size -> the most storages of it in use at once
        self.high = 0  # peak_bound: the most bytes of this cache's storages in use at once
        self._entries: list = []  # [UntypedStorage], least recently handed out first
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)
        self.reused = self.allocated = 0  # counters (tests, benchmarks)
        self.before_fresh: list = []  # run before a new allocation (a watching `GatheredPool` frees its idle memory)

    def _free(self, storage) -> bool:
        return self._use_count(storage._cdata) == 1

    def empty(self, numel: int, dtype, *, alignment: int = 4096):
        """An uninitialised 1-D host tensor [numel] of `dtype` whose data_ptr() is a multiple of `alignment`
        bytes and whose storage holds aligned_numel(numel) elements from data_ptr() on (legal for O_DIRECT),
        from a free cached storage of the same size when there is one."""
        from .aio import aligned_numel, aligned_view

        torch = self._torch
        size = aligned_numel(numel, dtype, alignment) * dtype.itemsize + alignment
        storage, fresh = None, False
        with self._lock:
            if self._use_count is not None:
                hit = next((i for i, s in enumerate(self._entries) if s.nbytes() == size and self._free(s)), None)
                if hit is not None:
                    storage = self._entries.pop(hit)
                    self.reused += 1
            if storage is None:
                for hook in self.before_fresh:
                    hook()
                storage, fresh = torch.empty(size, dtype=torch.uint8).untyped_storage(), True
                self.allocated += 1
            if self._use_count is not None and self.max_idle_bytes > 0:
                self._entries.append(storage)
                self._trim(storage)
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        if fresh:
            advise_huge_pages(raw)
        return aligned_view(raw, numel, dtype, alignment)

    def _trim(self, current=None) -> None:
        """Drop free storages beyond `per_size` of a size and beyond `max_idle_bytes` in all (oldest first);
        peak_bound: beyond `high` held in all (`current`, being handed out, counts as in use)."""
        free = [s for s in self._entries if s is not current and self._free(s)]
        if self.peak_bound:
            idle = sum(s.nbytes() for s in free)
            held = sum(s.nbytes() for s in self._entries)
            self.high = max(self.high, held - idle)
            drop = set()
            for s in free:  # oldest first
                if held <= self.high:
                    break
                drop.add(id(s))
                held -= s.nbytes()
            if drop:
                self._entries = [s for s in self._entries if id(s) not in drop]
            return
        seen: dict[int, int] = {}
        idle = sum(s.nbytes() for s in free)
        drop = set()
        if self.size_peak:  # free ones kept per size: the most of that size in use at once, less those in use now
            busy: dict[int, int] = {}
            for s in self._entries:
                if s is current or not self._free(s):
                    busy[s.nbytes()] = busy.get(s.nbytes(), 0) + 1
            for n, k in busy.items():
                self._size_high[n] = max(self._size_high.get(n, 0), k)
        for s in reversed(free):  # newest first: they are kept
            n = s.nbytes()
            seen[n] = seen.get(n, 0) + 1
            keep = self._size_high.get(n, 1) - busy.get(n, 0) if self.size_peak else self.per_size
            if seen[n] > keep:
                drop.add(id(s))
                idle -= s.nbytes()
        for s in free:  # oldest first
            if idle <= self.max_idle_bytes:
                break
            if id(s) not in drop:
                drop.add(id(s))
                idle -= s.nbytes()
        if drop:
            self._entries = [s for s in self._entries if id(s) not in drop]

    def clear(self) -> None:
        """Drop the free storages (those in use stay tracked)."""
        with self._lock:
            if self._use_count is not None:
                self._entries = [s for s in self._entries if not self._free(s)]

    def idle_bytes(self) -> int:
        """Bytes of the free storages the cache holds now."""
        with self._lock:
            return sum(s.nbytes() for s in self._entries if self._use_count is not None and self._free(s))


RECYCLE_MAX_IDLE_BYTES = 1 << 30
recycled = RecycledBuffers(RECYCLE_MAX_IDLE_BYTES, per_size=None)
"""The process's cache of offload host buffers (`RecycledBuffers`; at most 1 GiB of free storages, per size as
many as were in use at once: ZeRO-3's reduce-scatter buckets and gradient staging buffers, two of a size alive at
a time, were mapped afresh every unit with one kept per size - session 31, bench/README.md)."""


def host_empty(numel: int, dtype, device):
    """An uninitialised 1-D tensor [numel] on `device`: from `recycled` on the host (page-aligned), a plain
    `torch.empty` on an accelerator (whose caching allocator already reuses memory)."""
    import torch

    from .aio import HOST

    device = torch.device(device)
    if device.type == HOST.type:
        return recycled.empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)


def _swap_available() -> bool:
    import torch

    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


_SWAP = _swap_available()  # without it (another torch) the pool allocates and frees as before


class GatheredPool:
    """The memory of released ZeRO-3 full buffers handed to the next unit gathered, within the peak.

    A unit's full buffer (`zero.stage3_params.ShardedUnit.full`) is freed when the unit is released and
    allocated again when it (or the next unit) is gathered: on the host, a fresh mapping whose pages the kernel
    zeroes on first touch, twice per unit and step (forward and backward). Measured here (GPT 4 x 2048, ZeRO-3
    fp32, world 2): ~1 s of system time per step went to faulting in and zeroing those buffers and autograd's
    weight gradients (bench/README.md, session 30). `release` moves the memory out of the unit's storage into
    this pool (`UntypedStorage._swap_data_ptr_`: the storage object stays, so tensors autograd saved still
    see the unit's values once it is gathered again) and `acquire` moves memory of the same byte size back in.

    Bound: the pool keeps idle memory only while live + idle <= the most bytes ever live at once (`high`),
    so the gathered buffers never hold more than at their own peak (`offload.budget`'s "gathered" term). Idle
    memory is also given up (`drop_idle`) before a watched cache (`watch`) allocates afresh, so a buffer is not
    idle while a new one is mapped beside it: `Stage3Strategy` watches the offload path's `recycled` and its
    weight-gradient cache under offload, and the 4Ψ-capped NVMe test (`test_bigger_than_memory`) then peaks
    where it did without the pool (without offload nothing is watched: the pool is bounded by its peak alone,
    +11% RSS measured for 0.69x the step time, bench/README.md session 30). Thread-safe; host storages only.

    `buffers`: the same units' shard-sized host buffers (gradient shards, shard copies), by default a
    `RecycledBuffers` bounded by its own peak, so a rank's gradient shards, all alive at the step, are reused
    whole by the next step. `buckets`: their reduce-scatter buckets (one in flight while the next is filled:
    by default 2 kept per size, at most RECYCLE_MAX_IDLE_BYTES). Under offload both are the process's
    `recycled` (per size as many as were in use at once), whose storages the offload budget counts.
    """

    def __init__(self, buffers: RecycledBuffers | None = None, buckets: RecycledBuffers | None = None):
        import threading

        self.buffers = RecycledBuffers(None) if buffers is None else buffers
        self.buckets = RecycledBuffers(RECYCLE_MAX_IDLE_BYTES, per_size=2) if buckets is None else buckets
        self._lock = threading.Lock()
        self._idle: list = []  # UntypedStorage holding released memory, oldest first
        self._watched: list[RecycledBuffers] = []
        self.live = self.high = 0  # bytes held by gathered units now / at most so far
        self.reused = self.allocated = self.dropped = 0  # counters (tests, benchmarks)

    def watch(self, cache: RecycledBuffers) -> None:
        """Give up the idle memory before `cache` allocates a new storage (until `close`)."""
        if all(c is not cache for c in self._watched):
            cache.before_fresh.append(self.drop_idle)
            self._watched.append(cache)

    def idle_bytes(self) -> int:
        return sum(s.nbytes() for s in self._idle)

    def drop_idle(self) -> None:
        """Free the idle memory now."""
        with self._lock:
            self.dropped += len(self._idle)
            self._idle = []

    def acquire(self, storage, nbytes: int) -> bool:
        """Give the 0-byte `storage` `nbytes` bytes: a released buffer's memory of that size when one is
        idle, else a new allocation. Returns True for a new allocation (fresh pages: advise them)."""
        with self._lock:
            hit = next((i for i, s in enumerate(self._idle) if s.nbytes() == nbytes), None) if _SWAP else None
            if hit is not None:
                storage._swap_data_ptr_(self._idle.pop(hit))
                self.reused += 1
            else:
                storage.resize_(nbytes)
                self.allocated += 1
            self.live += nbytes
            self.high = max(self.high, self.live)
            while self._idle and self.live + self.idle_bytes() > self.high:
                self._idle.pop(0)
        return hit is None

    def release(self, storage) -> None:
        """Take `storage`'s memory (it is left with 0 bytes): kept for `acquire` within the bound, else freed."""
        import torch

        n = storage.nbytes()
        if n == 0:
            return
        with self._lock:
            self.live = max(0, self.live - n)
            if _SWAP and self.live + self.idle_bytes() + n <= self.high:
                spare = torch.UntypedStorage(0, device=storage.device)
                storage._swap_data_ptr_(spare)
                self._idle.append(spare)
                return
        storage.resize_(0)

    def clear(self) -> None:
        """Free every idle buffer (and `buffers`' and `buckets`' free storages)."""
        self.drop_idle()
        self.buffers.clear()
        self.buckets.clear()

    def close(self) -> None:
        """`clear`, and stop watching the caches."""
        self.clear()
        for cache in self._watched:
            cache.before_fresh[:] = [h for h in cache.before_fresh if getattr(h, "__self__", None) is not self]
        self._watched = []
