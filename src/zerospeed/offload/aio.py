"""Asynchronous file I/O of host tensors, the transport of ZeRO-Infinity's NVMe offload.

A thread pool runs `os.preadv` / `os.pwritev` on the tensor's own memory (no copy); both release the GIL, so
transfers overlap with compute. Pieces run in submission order, except that an urgent read's pieces go
before the queued pieces of every other request. With O_DIRECT the page cache is bypassed, which needs the buffer address, the
length and the file offset to be multiples of ALIGNMENT: `aligned_empty` makes such buffers. A request's
aligned prefix goes through an O_DIRECT fd and a tail shorter than ALIGNMENT through a buffered fd of the same
file (we do not pad: padding would write past the tensor and clobber whatever the file holds after it).
"""
from __future__ import annotations

import ctypes
import errno
import math
import os
import threading
import time
import itertools
import queue
from concurrent.futures import Future, wait as wait_futures

import torch

ALIGNMENT = 4096  # bytes; O_DIRECT needs buffer address, length and file offset multiples of this
HOST = torch.device("cpu")
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none


def _accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)  # torch >= 2.6
    return bool(acc is not None and acc.is_available())


def aligned_numel(numel: int, dtype: torch.dtype, alignment: int = ALIGNMENT) -> int:
    """`numel` (elements) rounded up so numel * itemsize is a multiple of `alignment` (bytes).
    Raises ValueError for numel < 0 or alignment < 1."""
    if numel < 0 or alignment < 1:
        raise ValueError(f"aligned_numel needs numel >= 0 and alignment >= 1, got numel={numel}, alignment={alignment}")
    step = alignment // math.gcd(alignment, dtype.itemsize)  # elements per aligned chunk
    return -(-numel // step) * step


def aligned_empty(numel: int, dtype: torch.dtype, *, alignment: int = ALIGNMENT, pin: bool = False) -> torch.Tensor:
    """Uninitialised 1-D HOST tensor of exactly `numel` elements whose data_ptr() is a multiple of `alignment` bytes.

    It is carved out of an over-allocated uint8 storage whose usable bytes from data_ptr() are
    aligned_numel(numel) * itemsize, so an O_DIRECT transfer of aligned_numel elements at data_ptr() is legal.
    pin=True pins the storage only when an accelerator is available. Raises ValueError when `alignment` is not a
    positive multiple of the dtype's itemsize.
    """
    if alignment < 1 or alignment % dtype.itemsize:
        raise ValueError(f"alignment must be a positive multiple of the {dtype} itemsize {dtype.itemsize}, "
                         f"got {alignment}")
    usable = aligned_numel(numel, dtype, alignment) * dtype.itemsize
    raw = torch.empty(usable + alignment, dtype=torch.uint8, device=HOST,
                      pin_memory=pin and _accelerator_available())
    return aligned_view(raw, numel, dtype, alignment)


def aligned_view(raw: torch.Tensor, numel: int, dtype: torch.dtype, alignment: int = ALIGNMENT) -> torch.Tensor:
    """`aligned_empty`'s carving: the [numel] `dtype` view of the 1-D uint8 tensor `raw` (at least
    aligned_numel(numel) * itemsize + alignment bytes) that starts at its first `alignment`-byte boundary."""
    usable = aligned_numel(numel, dtype, alignment) * dtype.itemsize
    skip = -raw.data_ptr() % alignment
    return raw[skip:skip + usable].view(dtype)[:numel]


def _transfer(fd: int, write: bool, addr: int, length: int, offset: int, direct: bool) -> int:
    """Move up to `length` bytes between memory at `addr` and `fd` at byte `offset`; returns bytes moved (fewer
    only at end of file, or after a direct transfer stopped at an unaligned count)."""
    done = 0
    while done < length:
        buf = (ctypes.c_char * (length - done)).from_address(addr + done)
        n = os.pwritev(fd, [buf], offset + done) if write else os.preadv(fd, [buf], offset + done)
        if n <= 0:
            break
        done += n
        if direct and n % ALIGNMENT:  # continuing would be unaligned: the caller finishes buffered
            break
    return done


class _Request:
    """One submitted read or write: `nbytes` bytes at memory `addr` <-> file `path` at byte `offset`."""

    def __init__(self, path: str, tensor: torch.Tensor, offset: int, write: bool, direct_fd: int | None):
        self.path, self.tensor, self.offset, self.write = path, tensor, offset, write  # tensor: keeps memory alive
        self.addr, self.nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        self.direct_fd = direct_fd
        self.direct_end = self.nbytes - self.nbytes % ALIGNMENT if direct_fd is not None else 0
        self.moved = self.direct_moved = self.pending = 0
        self.t0 = time.perf_counter()


class IOHandle:
    """A submitted request. The tensor must stay untouched until wait() returns."""

    def __init__(self, request: _Request, futures: list):
        self._request, self._futures = request, futures

    def wait(self) -> int:
        """Block until every piece is done; returns bytes transferred. Re-raises the first I/O error (an OSError
        carrying the path) after all pieces have stopped, so no worker still touches the tensor."""
        error = None
        for f in self._futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                error = error or e
        if error is not None:
            raise error
        return self._request.moved

    def done(self) -> bool:
        return all(f.done() for f in self._futures)


class _PriorityPool:
    """Worker threads that run submitted calls lowest priority number first (FIFO within a priority): an
    urgent read (a parameter shard the training thread is about to all-gather) overtakes the queued pieces
    of background transfers (optimizer tiles, write-backs) instead of waiting behind them."""

    def __init__(self, workers: int, name: str):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((priority, next(self._seq), future, fn, args))
        return future

    def shutdown(self) -> None:
        """Run everything queued, then stop the threads."""
        for _ in self._threads:
            self._queue.put((_LAST, next(self._seq), None, None, None))
        for t in self._threads:
            t.join()

    def _work(self) -> None:
        while True:
            _, _, future, fn, args = self._queue.get()
            if future is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                future.set_exception(e)


URGENT, NORMAL, _LAST = 0, 1, 2  # request priorities (AsyncIO.submit_read(urgent=True) -> URGENT)


class AsyncIO:
    """Thread-pool asynchronous file I/O of host tensors; config mirrors DeepSpeed's `aio` block.

    block_size: bytes per request piece (rounded up to a multiple of ALIGNMENT). thread_count * queue_depth
    worker threads run the pieces (each thread does one blocking syscall at a time, so DeepSpeed's "outstanding
    requests per thread" become threads). single_submit=True runs a request's pieces one after another on one
    worker instead of fanning them out. overlap_events=False makes submit_* block until the request is done
    (errors still surface at wait()): no overlap with the caller, useful to measure or debug.
    use_direct: None = O_DIRECT where the file system accepts it (open or I/O fails with EINVAL, e.g. tmpfs,
    -> buffered) and the tensor address and offset are aligned; True = require it (ValueError for an unaligned
    tensor/offset, OSError where the file system refuses it); False = never. Counters: bytes_read, bytes_written,
    direct_bytes (moved through O_DIRECT), read_seconds, write_seconds (submit-to-completion wall time, summed
    per request). Raises ValueError for a size or count < 1.
    """

    def __init__(self, *, block_size: int = 1 << 20, queue_depth: int = 8, thread_count: int = 1,
                 single_submit: bool = False, overlap_events: bool = True, use_direct: bool | None = None):
        for key, value in (("block_size", block_size), ("queue_depth", queue_depth), ("thread_count", thread_count)):
            if value < 1:
                raise ValueError(f"aio.{key} must be >= 1, got {value}")
        if use_direct and not _O_DIRECT:
            raise ValueError("use_direct=True but this platform has no O_DIRECT; use use_direct=None")
        self.block_size = -(-block_size // ALIGNMENT) * ALIGNMENT
        self.queue_depth, self.thread_count = queue_depth, thread_count
        self.single_submit, self.overlap_events, self.use_direct = single_submit, overlap_events, use_direct
        self.bytes_read = self.bytes_written = self.direct_bytes = 0
        self.read_seconds = self.write_seconds = 0.0
        self._pool = _PriorityPool(thread_count * queue_depth, "zerospeed-aio")
        self._fds: dict[tuple[str, bool, bool], int] = {}
        self._no_direct: set[str] = set()  # paths whose file system refused O_DIRECT
        self._lock = threading.Lock()
        self._direct = False
        self._closed = False

    @classmethod
    def from_config(cls, aio_cfg, *, use_direct: bool | None = None) -> "AsyncIO":
        """Build from an object with block_size, queue_depth, thread_count, single_submit, overlap_events."""
        return cls(block_size=aio_cfg.block_size, queue_depth=aio_cfg.queue_depth, thread_count=aio_cfg.thread_count,
                   single_submit=aio_cfg.single_submit, overlap_events=aio_cfg.overlap_events, use_direct=use_direct)

    @property
    def direct(self) -> bool:
        """True if the last submitted request used O_DIRECT (file accepted it, tensor and offset aligned)."""
        return self._direct

    def submit_write(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Write the bytes of `tensor` (contiguous HOST tensor, any dtype) at byte `offset` of `path` (created if
        missing, mode 0o600). Do not modify the tensor until the handle is waited. Raises ValueError for a bad
        tensor/offset, OSError (with the path) if the file cannot be opened."""
        return self._submit(path, tensor, offset, write=True)

    def submit_read(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int = 0, *,
                    urgent: bool = False) -> IOHandle:
        """Read tensor.nbytes bytes at byte `offset` of `path` into `tensor`. A file too short makes wait() raise
        OSError naming the path, the bytes wanted and the bytes the file holds. urgent: its pieces run before
        every queued piece of non-urgent requests (those already running finish first)."""
        return self._submit(path, tensor, offset, write=False, priority=URGENT if urgent else NORMAL)

    def write(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int = 0) -> int:
        """submit_write + wait; returns bytes written."""
        return self.submit_write(path, tensor, offset).wait()

    def read(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int = 0) -> int:
        """submit_read + wait; returns bytes read."""
        return self.submit_read(path, tensor, offset).wait()

    def close_file(self, path: str | os.PathLike) -> None:
        """Close the cached fds of `path` (no request on it may be in flight); a deleted file frees its disk only
        once no fd holds it."""
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            for key in [k for k in self._fds if k[0] == path]:
                os.close(self._fds.pop(key))

    def close(self) -> None:
        """Wait for every request, shut the pool and close the cached fds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _submit(self, path: str | os.PathLike, tensor: torch.Tensor, offset: int, *, write: bool,
                priority: int = NORMAL) -> IOHandle:
        if self._closed:
            raise RuntimeError("this AsyncIO is closed; create a new one")
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != HOST.type or not tensor.is_contiguous():
            where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"AsyncIO moves contiguous {HOST} tensors, got {where}: copy it into a host buffer "
                             "(aligned_empty) first")
        if offset < 0:
            raise ValueError(f"file offset must be >= 0 bytes, got {offset}")
        path = os.path.abspath(os.fspath(path))
        misaligned = tensor.data_ptr() % ALIGNMENT, offset % ALIGNMENT
        if self.use_direct and any(misaligned):
            raise ValueError(f"use_direct=True needs the tensor address and file offset to be multiples of "
                             f"{ALIGNMENT} bytes; got address % {ALIGNMENT} = {misaligned[0]}, offset {offset}: "
                             "allocate with aligned_empty() and use aligned offsets, or use_direct=None")
        direct_fd = None
        if self.use_direct is not False and _O_DIRECT and not any(misaligned):
            direct_fd = self._fd(path, write, direct=True)
        if direct_fd is None:
            self._fd(path, write, direct=False)  # open (and create) now: a bad path fails at submit
        self._direct = direct_fd is not None
        req = _Request(path, tensor, offset, write, direct_fd)
        spans = [(s, min(s + self.block_size, req.nbytes)) for s in range(0, req.nbytes, self.block_size)]
        groups = ([spans] if spans else []) if self.single_submit else [[s] for s in spans]
        req.pending = len(groups)
        futures = [self._pool.submit(priority, self._run, req, g) for g in groups]
        if not self.overlap_events:
            wait_futures(futures)
        return IOHandle(req, futures)

    def _fd(self, path: str, write: bool, direct: bool) -> int | None:
        """The cached fd of (path, mode); None if O_DIRECT was asked and the file system refuses it."""
        with self._lock:
            key = (path, write, direct)
            if key in self._fds:
                return self._fds[key]
            if direct and path in self._no_direct:
                return None
            flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
            try:
                fd = os.open(path, flags, 0o600)
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise OSError(e.errno, f"cannot open for {'writing' if write else 'reading'}: {e.strerror}",
                                  path) from e
                return self._refuse(path, e)
            self._fds[key] = fd
            return fd

    def _refuse(self, path: str, error: OSError) -> None:
        """Record that `path`'s file system refuses O_DIRECT (EINVAL); an error if use_direct=True."""
        if self.use_direct:
            raise OSError(errno.EINVAL, "the file system refuses O_DIRECT: put nvme_path on a local NVMe file "
                          "system (ext4, xfs) or use use_direct=None to fall back to buffered I/O", path) from error
        self._no_direct.add(path)
        self._direct = False

    def _run(self, req: _Request, spans: list[tuple[int, int]]) -> int:
        moved = direct = 0
        try:
            for start, end in spans:
                d, b = self._piece(req, start, end)
                direct, moved = direct + d, moved + d + b
            return moved
        finally:
            with self._lock:
                req.moved += moved
                req.direct_moved += direct
                self.direct_bytes += direct
                req.pending -= 1
                if req.pending == 0:
                    seconds = time.perf_counter() - req.t0
                    if req.write:
                        self.bytes_written += req.moved
                        self.write_seconds += seconds
                    else:
                        self.bytes_read += req.moved
                        self.read_seconds += seconds

    def _piece(self, req: _Request, start: int, end: int) -> tuple[int, int]:
        """Bytes [start, end) of the request: the part below direct_end through O_DIRECT, the rest buffered.
        Returns (direct bytes, buffered bytes)."""
        pos, direct = start, 0
        if pos < req.direct_end and req.path not in self._no_direct:
            stop = min(end, req.direct_end)
            try:
                direct = _transfer(req.direct_fd, req.write, req.addr + pos, stop - pos, req.offset + pos, True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise self._error(e, req, pos, stop - pos) from e
                self._refuse(req.path, e)  # e.g. a FUSE file system that accepts the flag but not the I/O
            pos += direct
        if pos < end:
            fd = self._fd(req.path, req.write, direct=False)
            try:
                pos += _transfer(fd, req.write, req.addr + pos, end - pos, req.offset + pos, False)
            except OSError as e:
                raise self._error(e, req, pos, end - pos) from e
            if pos < end:
                size = os.fstat(fd).st_size
                raise OSError(errno.EIO, f"short {'write' if req.write else 'read'}: wanted {req.nbytes} bytes at "
                              f"offset {req.offset}, got {max(0, min(size - req.offset, req.nbytes))} (the file holds "
                              f"{size} bytes); read with the size and offset it was written with", req.path)
        return direct, pos - start - direct

    @staticmethod
    def _error(e: OSError, req: _Request, pos: int, length: int) -> OSError:
        return OSError(e.errno, f"{e.strerror} while {'writing' if req.write else 'reading'} {length} bytes at "
                       f"offset {req.offset + pos}", req.path)
