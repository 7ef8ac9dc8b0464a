"""offload.hostmem: recycled host buffers (handed out again only when nothing else holds them) and the
huge-page advice for fresh large buffers, and the move of written ones onto huge pages."""
import gc

import torch

from zerospeed.offload.hostmem import (RecycledBuffers, advise_huge_pages, collapse_huge_pages, collapse_huge_range,
                                       drop_file_pages, host_empty, trim_heap)
from zerospeed.testing.rss import huge_page_bytes, smaps_field

MB = 1 << 20


def test_a_buffer_is_reused_only_once_every_view_of_it_is_gone():
    cache = RecycledBuffers(max_idle_bytes=64 * MB)
    a = cache.empty(1000, torch.float32)
    first = a.data_ptr()
    assert first % 4096 == 0 and a.numel() == 1000 and a.dtype == torch.float32
    view = a[10:20]
    del a
    b = cache.empty(1000, torch.float32)  # `view` still holds the first storage
    assert b.data_ptr() != first and (cache.reused, cache.allocated) == (0, 2)
    del view, b
    gc.collect()
    c = cache.empty(1000, torch.float32)
    assert c.data_ptr() == first and cache.reused == 1
    del c
    d = cache.empty(250, torch.float64)  # another dtype of the same byte size (2 pages) reuses too
    assert cache.reused == 2 and d.numel() == 250 and d.data_ptr() % 4096 == 0


def test_a_buffer_an_io_request_holds_is_not_handed_out(tmp_path):
    """An IOHandle keeps its tensor: until it is waited and dropped, the storage stays in use."""
    from zerospeed.offload.aio import AsyncIO
    cache = RecycledBuffers(max_idle_bytes=64 * MB)
    aio = AsyncIO(thread_count=1)
    try:
        buf = cache.empty(4096, torch.float32).fill_(3.0)
        ptr = buf.data_ptr()
        handle = aio.submit_write(tmp_path / "f", buf)
        del buf
        other = cache.empty(4096, torch.float32)
        assert other.data_ptr() != ptr
        handle.wait()
        del handle, other
        cache.empty(4096, torch.float32)
        assert cache.reused == 1  # a free one of the two (the pool's worker may still hold its request a moment)
        back = torch.empty(4096)
        aio.read(tmp_path / "f", back)
        assert torch.equal(back, torch.full((4096,), 3.0))
    finally:
        aio.close()


def test_free_storages_are_bounded_per_size_and_in_bytes():
    cache = RecycledBuffers(max_idle_bytes=3 * MB, per_size=1)
    held = [cache.empty(MB // 4, torch.float32) for _ in range(3)]  # 3 x 1 MiB (+ a page of alignment)
    del held
    small = cache.empty(16, torch.float32)  # any call trims: one free storage of the 1 MiB size is kept
    assert cache.idle_bytes() == MB + 4096  # usable bytes + a page of alignment slack
    big = [cache.empty(MB // 2, torch.float32) for _ in range(2)]  # 2 MiB each
    del big
    small2 = cache.empty(16, torch.float32)  # one 2 MiB storage kept; with the 1 MiB one over 3 MiB: that goes
    assert cache.idle_bytes() == 2 * MB + 4096 and small.data_ptr() != small2.data_ptr()


def test_host_empty_and_huge_page_advice():
    t = host_empty(10 * MB // 4, torch.float32, torch.device("cpu"))
    assert t.shape == (10 * MB // 4,) and t.data_ptr() % 4096 == 0
    assert advise_huge_pages(torch.empty(16)) is False  # under 2 MiB: nothing to advise
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = "[never]" not in f.read()
    except OSError:
        thp = False
    assert advise_huge_pages(torch.empty(4 * MB)) is thp


def _collapse_supported() -> bool:
    """MADV_COLLAPSE: Linux >= 6.1 with transparent huge pages not disabled."""
    import platform
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = "[never]" not in f.read()
    except (OSError, ValueError):
        return False
    return thp and (major, minor) >= (6, 1)


def test_collapse_moves_a_written_tensor_onto_huge_pages_in_place():
    """A 16 MiB tensor already written: its 2 MiB-aligned interior (>= 12 MiB) is on huge pages afterwards, at
    the same address with the same values; what cannot be collapsed is refused without an error. The tensor
    lives in a fresh private anonymous mapping of its own (a torch allocation may reuse memory an earlier test left on
    huge pages, and then nothing would be left to move)."""
    import mmap

    region = mmap.mmap(-1, 16 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.float32)
    t.copy_(torch.arange(4 * MB, dtype=torch.float32))
    want, ptr, before = t.clone(), t.data_ptr(), huge_page_bytes(t)
    supported = _collapse_supported()
    assert collapse_huge_pages(t) is supported
    assert t.data_ptr() == ptr and torch.equal(t, want)
    if supported:
        assert huge_page_bytes(t) - before >= 12 * MB, (before, huge_page_bytes(t))
    assert collapse_huge_pages(torch.empty(16)) is False  # under 2 MiB
    assert collapse_huge_pages(torch.empty(4 * MB, device="meta")) is False
    del t


def test_collapse_of_an_address_range_another_library_mapped():
    """`collapse_huge_range` on the addresses of a written 8 MiB mapping (as an AOTInductor package's constants):
    its 2 MiB-aligned interior (>= 4 MiB) onto huge pages, the data unchanged; under one huge page refused."""
    import mmap

    region = mmap.mmap(-1, 8 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.float32)
    t.copy_(torch.arange(2 * MB, dtype=torch.float32))
    want, before = t.clone(), huge_page_bytes(t)
    supported = _collapse_supported()
    assert collapse_huge_range(t.data_ptr(), t.data_ptr() + 8 * MB) is supported
    assert torch.equal(t, want)
    if supported:
        assert huge_page_bytes(t) - before >= 4 * MB, (before, huge_page_bytes(t))
    assert collapse_huge_range(t.data_ptr(), t.data_ptr() + MB) is False
    del t


def test_dropping_the_pages_of_a_file_mapping_only_lowers_the_rss(tmp_path):
    """`drop_file_pages` on an 8 MiB private file mapping read once (as an AOTInductor library's embedded
    constants): its resident bytes fall from >= 8 MiB to under 1 MiB, and reading it again gives the file's
    bytes. `trim_heap` runs (glibc here)."""
    import mmap

    path = tmp_path / "blob"
    want = torch.arange(2 * MB, dtype=torch.float32)
    path.write_bytes(want.numpy().tobytes())
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 8 * MB, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    t = torch.frombuffer(region, dtype=torch.float32)
    assert torch.equal(t, want)
    start = t.data_ptr()  # the mapping's own start (a neighbour may start within 8 MiB below it)
    assert start in smaps_field("Rss")
    assert smaps_field("Rss")[start] >= 8 * MB
    assert drop_file_pages(t.data_ptr(), t.data_ptr() + 8 * MB) is True
    assert smaps_field("Rss")[start] < MB, smaps_field("Rss")[start]
    assert torch.equal(t, want)  # read from the file again
    assert drop_file_pages(t.data_ptr(), t.data_ptr()) is False  # nothing to drop
    assert trim_heap() is True
    del t


def test_gathered_pool_hands_released_memory_to_the_next_unit_within_the_peak():
    """GatheredPool: a released storage's memory goes to the next storage of that byte size (the storage
    objects stay: a tensor saved on the released one sees 0 bytes, as after resize_(0)); idle memory never takes
    live + idle above the most bytes live at once."""
    from zerospeed.offload.hostmem import GatheredPool
    pool = GatheredPool()
    a, b, c = (torch.empty(256, dtype=torch.float32) for _ in range(3))
    for t in (a, b, c):
        t.untyped_storage().resize_(0)
    assert pool.acquire(a.untyped_storage(), 1024) and pool.acquire(b.untyped_storage(), 1024)
    saved = a[:10]  # a view autograd might hold
    assert (pool.live, pool.high, pool.allocated) == (2048, 2048, 2)
    a.fill_(5.0)
    ptr = a.data_ptr()
    pool.release(a.untyped_storage())
    assert a.untyped_storage().nbytes() == 0 and saved.untyped_storage().nbytes() == 0
    assert (pool.live, pool.idle_bytes()) == (1024, 1024)
    assert not pool.acquire(c.untyped_storage(), 1024)  # the released memory, not a new allocation
    assert c.data_ptr() == ptr and bool((c == 5.0).all()) and pool.reused == 1
    pool.release(c.untyped_storage())
    pool.release(b.untyped_storage())
    assert (pool.live, pool.idle_bytes()) == (0, 2048)
    d = torch.empty(0, dtype=torch.float32)  # another size: a new allocation, and idle memory beyond the peak goes
    assert pool.acquire(d.untyped_storage(), 4096) and d.untyped_storage().nbytes() == 4096
    assert pool.high == 4096 and pool.live + pool.idle_bytes() <= pool.high
    pool.release(d.untyped_storage())
    assert pool.live + pool.idle_bytes() <= pool.high
    saved2 = torch.empty(0)
    pool.release(saved2.untyped_storage())  # 0 bytes: nothing to take
    pool.clear()
    assert pool.idle_bytes() == 0


def test_gathered_pool_gives_up_idle_memory_before_a_watched_cache_maps_a_new_buffer():
    """Under offload the pool watches the offload path's caches: a new mapping in one of them first frees the
    pool's idle memory (so no released buffer sits idle beside it), a cache hit does not; `close` stops it."""
    from zerospeed.offload.hostmem import GatheredPool
    cache = RecycledBuffers(1 << 20)
    pool = GatheredPool(cache, cache)
    pool.watch(cache)
    pool.watch(cache)  # once only
    assert len(cache.before_fresh) == 1
    a, b = torch.empty(0), torch.empty(0)
    pool.acquire(a.untyped_storage(), 4096)
    pool.acquire(b.untyped_storage(), 4096)
    pool.release(a.untyped_storage())
    assert pool.idle_bytes() == 4096
    t = cache.empty(1000, torch.float32)  # a new mapping: the idle buffer goes first
    assert pool.idle_bytes() == 0 and pool.dropped == 1 and cache.allocated == 1
    del t
    gc.collect()
    pool.release(b.untyped_storage())
    assert pool.idle_bytes() == 4096
    t = cache.empty(1000, torch.float32)  # a cache hit: nothing new mapped, the idle buffer stays
    assert cache.reused == 1 and pool.idle_bytes() == 4096
    pool.close()
    assert cache.before_fresh == [] and pool.idle_bytes() == 0
    del t


def test_per_size_none_keeps_as_many_of_a_size_as_were_in_use_at_once():
    """per_size=None: two buffers of a size alive at once (a bucket reduced while the next is filled) are both
    reused by the next round, where per_size=1 maps the second afresh each round; never more of a size than
    its peak in use."""
    counts = []
    for per_size in (None, 1):
        cache = RecycledBuffers(1 << 30, per_size=per_size)
        for _ in range(3):  # a round: two 1000-element buffers at once, then a 3000-element one on its own
            a, b = cache.empty(1000, torch.float32), cache.empty(1000, torch.float32)
            del a, b
            gc.collect()
            c = cache.empty(3000, torch.float32)
            del c
            gc.collect()
        counts.append((cache.allocated, cache.reused))
        if per_size is None:
            d = cache.empty(1000, torch.float32)
            assert [s.nbytes() for s in cache._entries].count(d.untyped_storage().nbytes()) == 2
            del d
    assert counts == [(3, 6), (5, 4)], counts


def test_a_peak_bound_cache_keeps_a_whole_set_of_buffers_for_the_next_step():
    """max_idle_bytes=None: everything that was in use at once is kept (any sizes), nothing beyond that."""
    cache = RecycledBuffers(None)
    step1 = [cache.empty(n, torch.float32) for n in (1000, 1000, 3000, 1000)]
    ptrs = sorted(t.data_ptr() for t in step1)
    high = cache.high
    assert cache.allocated == 4 and high == sum(t.untyped_storage().nbytes() for t in step1)
    del step1
    gc.collect()
    step2 = [cache.empty(n, torch.float32) for n in (1000, 3000, 1000, 1000)]
    assert sorted(t.data_ptr() for t in step2) == ptrs and (cache.allocated, cache.reused) == (4, 4)
    del step2
    gc.collect()
    big = cache.empty(5000, torch.float32)  # a new size: free ones go until the cache holds at most its peak
    assert cache.high == high and cache.allocated == 5
    assert sum(s.nbytes() for s in cache._entries) <= cache.high
