"""The NVMe offload I/O layer (`offload/aio.py`, `swap.py`, `preflight.py`) against real files under tmp_path."""
import errno
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections import namedtuple

import psutil
import pytest
import torch

from zerospeed.offload import aio as aio_mod
from zerospeed.offload import preflight
from zerospeed.offload.aio import ALIGNMENT, AsyncIO, aligned_empty, aligned_numel
from zerospeed.offload.preflight import OffloadResourceError, check_nvme_path, check_resources, format_bytes
from zerospeed.offload.swap import SWAP_DIR_NAME, BufferPool, SwapSpace, clear_stale

GiB = 2**30
BLOCK = 8192  # small block_size: multi-piece requests run on the pool


@pytest.fixture
def aio():
    io = AsyncIO(block_size=BLOCK, queue_depth=2, thread_count=2)
    yield io
    io.close()


def random_tensor(numel, dtype, aligned=True, seed=0):
    """Random bytes (NaN bit patterns included) in a 1-D tensor; compare with `raw`."""
    t = aligned_empty(numel, dtype) if aligned else torch.empty(numel + 1, dtype=dtype)[1:]
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(torch.randint(0, 256, (t.nbytes,), dtype=torch.uint8, generator=g))
    return t


def raw(t):
    return t.view(torch.uint8)


def odirect_supported(directory):
    try:
        fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    return hasattr(os, "O_DIRECT")


@pytest.mark.parametrize("dtype, numel, want", [
    (torch.float32, 0, 0), (torch.float32, 1, 1024), (torch.float32, 1024, 1024), (torch.float32, 1025, 2048),
    (torch.bfloat16, 1, 2048), (torch.int64, 513, 1024), (torch.uint8, 4097, 8192)])
def test_aligned_numel(dtype, numel, want):
    assert aligned_numel(numel, dtype) == want
    assert aligned_numel(numel, dtype, alignment=64) % (64 // dtype.itemsize) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("numel", [0, 1, 1000, 1025])
def test_aligned_empty_is_aligned_with_room_for_aligned_numel(dtype, numel):
    t = aligned_empty(numel, dtype, pin=True)
    assert t.shape == (numel,) and t.dtype == dtype and t.device == aio_mod.HOST
    assert t.data_ptr() % ALIGNMENT == 0
    room = t.untyped_storage().nbytes() - (t.data_ptr() - t.untyped_storage().data_ptr())
    assert room >= aligned_numel(numel, dtype) * dtype.itemsize
    if not torch.accelerator.is_available():
        assert not t.is_pinned()
    with pytest.raises(ValueError, match="multiple of the"):
        aligned_empty(4, torch.float32, alignment=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 3 * 4096, 5 * BLOCK + 100])
@pytest.mark.parametrize("offset", [0, 3 * 4096, 100])
def test_round_trip_lands_at_the_offset(aio, tmp_path, dtype, nbytes, offset):
    numel = max(nbytes // dtype.itemsize, 1 if nbytes else 0)
    src = random_tensor(numel, dtype, aligned=offset % 4096 == 0)
    path = tmp_path / "f.bin"
    assert aio.write(path, src, offset) == src.nbytes
    with open(path, "rb") as f:  # the bytes are where they were asked to be
        f.seek(offset)
        assert f.read() == bytes(raw(src).tolist())
    dst = aligned_empty(numel, dtype)
    raw(dst).fill_(7)
    assert aio.read(path, dst, offset) == src.nbytes
    assert torch.equal(raw(dst), raw(src))


def test_aligned_tensor_uses_o_direct_end_to_end(tmp_path):
    if not odirect_supported(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    io = AsyncIO(block_size=BLOCK, use_direct=None)
    src = random_tensor(5 * 4096 // 4, torch.float32)
    io.write(tmp_path / "d.bin", src)
    assert io.direct and io.direct_bytes == src.nbytes
    dst = aligned_empty(src.numel(), torch.float32)
    io.read(tmp_path / "d.bin", dst)
    assert io.direct and io.direct_bytes == 2 * src.nbytes and torch.equal(raw(dst), raw(src))
    tail = random_tensor(4096 // 4 + 3, torch.float32)  # aligned prefix direct, 12-byte tail buffered
    io.write(tmp_path / "t.bin", tail)
    assert io.direct and io.direct_bytes == 2 * src.nbytes + 4096
    io.close()


def test_use_direct_false_round_trips_buffered(tmp_path):
    io = AsyncIO(block_size=BLOCK, use_direct=False)
    src = random_tensor(3 * BLOCK, torch.float32)
    dst = aligned_empty(src.numel(), torch.float32)
    io.write(tmp_path / "b.bin", src)
    io.read(tmp_path / "b.bin", dst)
    assert torch.equal(raw(dst), raw(src)) and not io.direct and io.direct_bytes == 0
    io.close()


@pytest.mark.parametrize("refuse_at", ["open", "io"])
def test_refused_o_direct_falls_back_or_raises(tmp_path, monkeypatch, refuse_at):
    real_open, real_transfer = os.open, aio_mod._transfer

    def fake_open(path, flags, *args):
        if flags & aio_mod._O_DIRECT and refuse_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def fake_transfer(fd, write, addr, length, offset, direct):
        if direct and refuse_at == "io":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_transfer(fd, write, addr, length, offset, direct)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(aio_mod, "_transfer", fake_transfer)
    src = random_tensor(2 * BLOCK, torch.int64)
    io = AsyncIO(block_size=BLOCK, use_direct=None)
    io.write(tmp_path / "x.bin", src)
    dst = aligned_empty(src.numel(), torch.int64)
    io.read(tmp_path / "x.bin", dst)
    assert torch.equal(raw(dst), raw(src)) and not io.direct and io.direct_bytes == 0
    io.close()
    strict = AsyncIO(block_size=BLOCK, use_direct=True)
    with pytest.raises(OSError, match="refuses O_DIRECT") as e:
        strict.write(tmp_path / "y.bin", src)
    assert str(tmp_path / "y.bin") in str(e.value)
    with pytest.raises(ValueError, match="address % 4096 = 8"):
        strict.write(tmp_path / "y.bin", src[1:])
    strict.close()


@pytest.mark.parametrize("single_submit, overlap_events", [(True, True), (False, False)])
def test_submission_modes_round_trip(tmp_path, single_submit, overlap_events):
    io = AsyncIO(block_size=BLOCK, queue_depth=2, thread_count=2, single_submit=single_submit,
                 overlap_events=overlap_events)
    src = random_tensor(4 * BLOCK + 5, torch.uint8)
    h = io.submit_write(tmp_path / "m.bin", src)
    if not overlap_events:
        assert h.done()
    assert h.wait() == src.nbytes
    dst = aligned_empty(src.numel(), torch.uint8)
    assert io.read(tmp_path / "m.bin", dst) == src.nbytes and torch.equal(dst, src)
    io.close()


def test_concurrent_handles(aio, tmp_path):
    srcs = [random_tensor(BLOCK + 1000 * i, torch.float32, seed=i) for i in range(6)]
    span = aligned_numel(srcs[-1].numel(), torch.float32) * 4
    writes = [aio.submit_write(tmp_path / f"c{i % 2}.bin", t, (i // 2) * span) for i, t in enumerate(srcs)]
    assert [h.wait() for h in writes] == [t.nbytes for t in srcs] and all(h.done() for h in writes)
    dsts = [aligned_empty(t.numel(), torch.float32) for t in srcs]
    reads = [aio.submit_read(tmp_path / f"c{i % 2}.bin", d, (i // 2) * span) for i, d in enumerate(dsts)]
    for h in reads:
        h.wait()
    assert all(torch.equal(raw(d), raw(s)) for d, s in zip(dsts, srcs))


def test_urgent_requests_overtake_queued_ones():
    """One worker busy: queued normal pieces wait, an urgent one submitted last runs next (FIFO otherwise)."""
    import threading
    pool, gate, order = aio_mod._PriorityPool(1, "test-aio"), threading.Event(), []
    first = pool.submit(aio_mod.NORMAL, gate.wait)
    futures = [pool.submit(aio_mod.NORMAL, order.append, f"normal{i}") for i in range(3)]
    futures.append(pool.submit(aio_mod.URGENT, order.append, "urgent"))
    gate.set()
    for f in [first, *futures]:
        f.result(timeout=10)
    failing = pool.submit(aio_mod.NORMAL, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    pool.shutdown()
    assert order == ["urgent", "normal0", "normal1", "normal2"]


def test_urgent_read_round_trips(aio, tmp_path):
    src = random_tensor(5 * BLOCK, torch.float32)
    big = aio.submit_write(tmp_path / "big.bin", random_tensor(40 * BLOCK, torch.float32, seed=3))
    aio.write(tmp_path / "u.bin", src)
    dst = aligned_empty(src.numel(), torch.float32)
    aio.submit_read(tmp_path / "u.bin", dst, urgent=True).wait()
    big.wait()
    assert torch.equal(raw(dst), raw(src))


def test_short_and_missing_reads_name_the_path(aio, tmp_path):
    path = tmp_path / "short.bin"
    aio.write(path, random_tensor(5000, torch.uint8))
    with pytest.raises(OSError) as e:
        aio.read(path, aligned_empty(8192, torch.uint8))
    assert str(path) in str(e.value) and "wanted 8192" in str(e.value) and "got 5000" in str(e.value)
    if odirect_supported(tmp_path):  # the short O_DIRECT read did not make the file look O_DIRECT-hostile
        aio.read(path, aligned_empty(4096, torch.uint8))
        assert aio.direct and aio.direct_bytes == 4096 + 4096
    with pytest.raises(OSError, match="got 0") as e:
        aio.read(path, torch.empty(10, dtype=torch.uint8), offset=6000)
    with pytest.raises(FileNotFoundError) as e:
        aio.submit_read(tmp_path / "nope.bin", torch.empty(4))
    assert str(tmp_path / "nope.bin") in str(e.value)


def test_counters_bad_tensors_and_close(tmp_path):
    io = AsyncIO(block_size=BLOCK)
    a, b = random_tensor(3 * BLOCK, torch.uint8), random_tensor(100, torch.bfloat16)
    io.write(tmp_path / "a", a)
    io.write(tmp_path / "b", b, offset=4096)
    io.read(tmp_path / "a", aligned_empty(a.numel(), torch.uint8))
    assert (io.bytes_written, io.bytes_read) == (a.nbytes + b.nbytes, a.nbytes)
    assert io.write_seconds > 0 and io.read_seconds > 0
    with pytest.raises(ValueError, match="contiguous"):
        io.write(tmp_path / "a", torch.zeros(8)[::2])
    with pytest.raises(ValueError, match="offset must be >= 0"):
        io.write(tmp_path / "a", a, offset=-1)
    io.close()
    io.close()
    with pytest.raises(RuntimeError, match="closed"):
        io.write(tmp_path / "a", a)


def open_fds_under(directory):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return [t for t in targets if t.startswith(f"{directory}{os.sep}")]


def test_swap_space_lifecycle(tmp_path):
    io = AsyncIO(block_size=BLOCK)
    space = SwapSpace(tmp_path, rank=3, aio=io)
    assert space.path == tmp_path.resolve() / SWAP_DIR_NAME / f"{socket.gethostname()}-pid{os.getpid()}-rank3"
    owner = json.loads((space.path / "OWNER.json").read_text())
    assert (owner["pid"], owner["rank"], owner["hostname"]) == (os.getpid(), 3, socket.gethostname())
    assert space.file("layer/0.weight") != space.file("layer_0.weight")
    other = SwapSpace(tmp_path, rank=3, aio=io)  # a second space of the rank in this process: its own directory
    assert other.path.name.endswith("-rank3-2")
    x, y = random_tensor(3000, torch.float32), random_tensor(77, torch.bfloat16)
    handles = [space.write("layer/0.weight", x), space.write("m", y, offset=4096), other.write("m", x)]
    [h.wait() for h in handles]
    assert space.has("layer/0.weight") and not space.has("absent")
    assert space.bytes_on_disk() == x.nbytes + 4096 + y.nbytes
    back = aligned_empty(77, torch.bfloat16)
    space.read("m", back, offset=4096).wait()
    assert torch.equal(raw(back), raw(y))
    with pytest.raises(FileNotFoundError, match="absent"):
        space.read("absent", back)
    assert open_fds_under(space.path)
    space.close()
    assert not space.path.exists() and space.bytes_on_disk() == 0 and other.bytes_on_disk() == x.nbytes
    assert not open_fds_under(space.path)  # a deleted file held open would keep its disk space
    space.close()
    with pytest.raises(RuntimeError, match="closed"):
        space.write("m", y)
    other.close()
    assert not (tmp_path / SWAP_DIR_NAME).exists()
    io.close()


def make_rank_dir(base, name, owner, nbytes=1000):
    d = base / SWAP_DIR_NAME / name
    d.mkdir(parents=True)
    (d / "OWNER.json").write_text(owner if isinstance(owner, str) else json.dumps(owner))
    (d / "x.swp").write_bytes(b"\0" * nbytes)
    return d


def test_clear_stale(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])  # a pid that existed and is gone
    dead.wait()
    if psutil.pid_exists(dead.pid):
        pytest.skip(f"pid {dead.pid} was reused already")
    host, me, now = socket.gethostname(), os.getpid(), time.time()
    started = psutil.Process(me).create_time()
    gone = make_rank_dir(tmp_path, "gone", {"hostname": host, "pid": dead.pid, "rank": 0, "created": now}, 1234)
    reused = make_rank_dir(tmp_path, "reused", {"hostname": host, "pid": me, "rank": 0, "created": started - 3600})
    alive = make_rank_dir(tmp_path, "alive", {"hostname": host, "pid": me, "rank": 1, "created": now - 1})
    remote = make_rank_dir(tmp_path, "remote", {"hostname": host + "-other", "pid": dead.pid, "rank": 0,
                                                "created": now})
    old_junk = make_rank_dir(tmp_path, "old-junk", "{not json")
    os.utime(old_junk, (now - 7200, now - 7200))
    new_junk = make_rank_dir(tmp_path, "new-junk", "{not json")
    freed = format_bytes(sum(p.stat().st_size for p in gone.iterdir()))  # OWNER.json + 1234 bytes
    io = AsyncIO()
    own = SwapSpace(tmp_path, rank=0, aio=io)
    logger, records = logging.getLogger("zerospeed"), []
    handler = logging.Handler()
    handler.emit = records.append  # whether or not the logger propagates to the root (setup_logger stops it)
    logger.addHandler(handler)
    try:
        removed = clear_stale(tmp_path)
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert sorted(removed) == sorted([gone, reused, old_junk])
    assert all(d.exists() for d in (alive, remote, new_junk, own.path))
    assert not any(d.exists() for d in removed)
    assert any(f"pid {dead.pid} is not running" in m and f"freed {freed}" in m for m in messages)
    assert len(messages) == 3 and all(r.levelno == logging.WARNING for r in records)
    own.close()
    io.close()


def test_buffer_pool():
    pool = BufferPool(2, 1000, torch.float32, name="offload_param.buffer_size")
    assert pool.nbytes == 8000 and pool.free_count == 2
    a, b = pool.acquire(1000), pool.acquire(10)
    assert a.shape == (1000,) and b.shape == (10,) and a.data_ptr() % ALIGNMENT == b.data_ptr() % ALIGNMENT == 0
    assert a.data_ptr() != b.data_ptr() and pool.free_count == 0
    with pytest.raises(RuntimeError, match="all 2 swap buffers are in use.*raise buffer_count"):
        pool.acquire(1)
    pool.release(b)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(b)
    assert pool.acquire(5).data_ptr() == b.data_ptr()
    with pytest.raises(ValueError, match="1001 elements.*holds 1000.*raise offload_param.buffer_size"):
        pool.acquire(1001)
    with pytest.raises(ValueError, match="not a buffer of this pool"):
        pool.release(torch.zeros(3))


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 512, 1536, 3 * GiB // 2, 5 * 2**40)] == \
        ["0 B", "512 B", "1.50 KiB", "1.50 GiB", "5.00 TiB"]


def test_check_nvme_path(tmp_path, monkeypatch):
    key = "zero_optimization.offload_optimizer.nvme_path"
    assert check_nvme_path(tmp_path, key=key) == tmp_path.resolve() and os.listdir(tmp_path) == []
    with pytest.raises(OffloadResourceError, match=f"does not exist; create it \\(mkdir -p .*missing\\).*{key}"):
        check_nvme_path(tmp_path / "missing", key=key)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OffloadResourceError, match=f"is not a directory; point {key}"):
        check_nvme_path(tmp_path / "file", key=key)
    with pytest.raises(OffloadResourceError, match="is not set"):
        check_nvme_path(None, key=key)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(OffloadResourceError, match="not writable \\(no write permission\\)"):
        check_nvme_path(tmp_path, key=key)


def test_check_nvme_path_read_only_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: a 0o500 directory is still writable")
        with pytest.raises(OffloadResourceError, match="not writable"):
            check_nvme_path(ro, key="k")
    finally:
        ro.chmod(0o700)


@pytest.fixture
def machine(monkeypatch):
    """A node with 4 GiB of available RAM, 10 GiB free on every disk and an 8 MiB memlock limit."""
    monkeypatch.setattr(preflight.psutil, "virtual_memory", lambda: namedtuple("VM", "available")(4 * GiB))
    usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage(100 * GiB, 90 * GiB, 10 * GiB))
    monkeypatch.setattr(preflight.resource, "getrlimit", lambda r: (8 * 2**20, 8 * 2**20))


def test_check_resources_disk_sums_one_file_system(machine, tmp_path):
    check_resources(disk_bytes={tmp_path / "a": 3 * GiB}, local_ranks=2)  # 6 of 10 GiB: fine
    with pytest.raises(OffloadResourceError) as e:
        check_resources(disk_bytes={tmp_path / "a": 3 * GiB, tmp_path / "b": 3 * GiB}, local_ranks=2)
    msg = str(e.value)
    assert "disk at" in msg and "needs 12.00 GiB" in msg and "10.00 GiB is free" in msg and "nvme_path" in msg
    assert "host RAM" not in msg


def test_check_resources_disk_credit(machine, tmp_path):
    """Bytes this rank already wrote and the run frees as it starts (zero.Init's slices on NVMe) count
    as free, once per local rank: 12 GiB needed on a 10 GiB-free disk fits with 2 x 1 GiB of credit."""
    need = {tmp_path / "a": 3 * GiB, tmp_path / "b": 3 * GiB}
    check_resources(disk_bytes=need, local_ranks=2, disk_credit={tmp_path: 1 * GiB})
    with pytest.raises(OffloadResourceError, match="needs 12.00 GiB"):
        check_resources(disk_bytes=need, local_ranks=2, disk_credit={tmp_path: GiB // 2})


def test_check_resources_ram_and_memlock(machine, monkeypatch):
    check_resources(host_bytes=GiB, local_ranks=4)
    with pytest.raises(OffloadResourceError) as e:
        check_resources(host_bytes=GiB, pinned_bytes=GiB // 2, local_ranks=4, what="offload_optimizer")
    msg = str(e.value)
    assert "for offload_optimizer" in msg and "needs 6.00 GiB (4 local ranks x 1.50 GiB each)" in msg
    assert "4.00 GiB is available" in msg and "sub_group_size" in msg
    assert "each rank pins 512.00 MiB" in msg and "is 8.00 MiB" in msg and "ulimit -l" in msg
    assert "pin_memory: false" in msg
    monkeypatch.setattr(preflight.resource, "getrlimit", lambda r: (preflight.resource.RLIM_INFINITY,) * 2)
    check_resources(pinned_bytes=GiB)  # unlimited memlock, 1 of 4 GiB RAM
    with pytest.raises(ValueError, match="local_ranks >= 1"):
        check_resources(host_bytes=1, local_ranks=0)
