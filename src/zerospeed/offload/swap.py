"""Swap files of one rank on the NVMe drive, the clean-up of runs that died, and a pool of aligned I/O buffers.

Layout: <nvme_path>/zerospeed_swap/<hostname>-pid<pid>-rank<rank>/ holds OWNER.json ({"hostname", "pid", "rank",
"created"}: who made it and when, in seconds since the epoch) and one file per key. A second SwapSpace of the
same rank in the same process (e.g. optimizer states and parameters on one drive) gets the suffix "-2", "-3", ...
"""
from __future__ import annotations

import atexit
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import psutil
import torch

from ..utils.io import atomic_write
from .aio import AsyncIO, IOHandle, aligned_empty
from .preflight import format_bytes

SWAP_DIR_NAME = "zerospeed_swap"
OWNER_FILE = "OWNER.json"
STALE_UNOWNED_SECONDS = 3600  # a directory without a readable OWNER.json is removed once this old
PID_REUSE_SLACK = 1.0  # seconds; process start times are only known to about this precision

logger = logging.getLogger("zerospeed")
_open_dirs: set[Path] = set()  # rank directories of live SwapSpaces in this process: never stale
_open_lock = threading.Lock()


def _dir_bytes(path: Path) -> int:
    """Sum of the sizes of the regular files under `path`, in bytes."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


class SwapSpace:
    """This rank's swap directory; keys (non-empty strings) map to one file each.

    Files are removed by close(), which is also registered with atexit and is idempotent. `aio` does the I/O
    and stays owned by the caller (close() only closes its fds of the swap files).
    """

    def __init__(self, nvme_path: str | os.PathLike, *, rank: int, aio: AsyncIO):
        self.aio, self.rank = aio, rank
        base = Path(nvme_path).resolve() / SWAP_DIR_NAME
        stem = f"{socket.gethostname()}-pid{os.getpid()}-rank{rank}"
        with _open_lock:
            n = 1
            while (base / (stem if n == 1 else f"{stem}-{n}")) in _open_dirs:
                n += 1
            self.path = base / (stem if n == 1 else f"{stem}-{n}")
            _open_dirs.add(self.path)
        base.mkdir(exist_ok=True)  # FileNotFoundError if nvme_path itself is missing (check_nvme_path first)
        if self.path.exists():  # left by an earlier process that had our pid: stale by construction
            shutil.rmtree(self.path)
        self.path.mkdir()
        owner = {"hostname": socket.gethostname(), "pid": os.getpid(), "rank": rank, "created": time.time()}
        atomic_write(self.path / OWNER_FILE, lambda p: p.write_text(json.dumps(owner)))
        self._handles: list[IOHandle] = []
        self._closed = False
        atexit.register(self.close)

    def file(self, key: str) -> Path:
        """The file of `key`: the key with characters other than [A-Za-z0-9._-] replaced by "_", plus a hash of
        the key when that changed it (so "a/b" and "a_b" stay apart) and ".swp". Raises ValueError for ""."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"swap keys are non-empty strings, got {key!r}")
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", key)[:150]
        if safe != key:
            safe += "-" + hashlib.sha1(key.encode()).hexdigest()[:10]
        return self.path / f"{safe}.swp"

    def write(self, key: str, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Start writing `tensor`'s bytes at byte `offset` of the file of `key` (see AsyncIO.submit_write)."""
        return self._track(self.aio.submit_write(self._live_file(key), tensor, offset))

    def read(self, key: str, into: torch.Tensor, offset: int = 0, *, urgent: bool = False) -> IOHandle:
        """Start reading into.nbytes bytes at byte `offset` of the file of `key` into `into` (urgent: ahead of
        queued non-urgent transfers, `AsyncIO.submit_read`). Raises FileNotFoundError if nothing was written
        under `key`."""
        path = self._live_file(key)
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, f"no swap file for key {key!r}: write it before reading it",
                                    str(path))
        return self._track(self.aio.submit_read(path, into, offset, urgent=urgent))

    def has(self, key: str) -> bool:
        """True once a write of `key` was submitted (and until close())."""
        return self.file(key).exists()

    @property
    def closed(self) -> bool:
        return self._closed

    def remove(self, key: str) -> None:
        """Delete the file of `key` (its requests must be finished: wait for their handles first), so the
        disk space is free at once. No-op if there is none."""
        path = self._live_file(key)
        self.aio.close_file(path)
        path.unlink(missing_ok=True)

    def bytes_on_disk(self) -> int:
        """Sum of the sizes of the swap files (OWNER.json excluded), in bytes; 0 after close()."""
        return sum(p.stat().st_size for p in self.path.glob("*.swp")) if self.path.exists() else 0

    def close(self) -> None:
        """Wait for outstanding requests (their errors are logged, not raised), close the fds, remove the
        directory (and zerospeed_swap/ if it is left empty). Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for handle in self._handles:
            try:
                handle.wait()
            except Exception as e:  # noqa: BLE001 - the files are being thrown away
                logger.warning(f"swap I/O failed while closing {self.path}: {e}")
        self._handles.clear()
        if self.path.exists():
            for p in self.path.iterdir():
                self.aio.close_file(p)
            shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.path.parent.rmdir()
        except OSError:
            pass  # not empty: other ranks' directories
        with _open_lock:
            _open_dirs.discard(self.path)

    def _live_file(self, key: str) -> Path:
        if self._closed:
            raise RuntimeError(f"SwapSpace {self.path} is closed")
        return self.file(key)

    def _track(self, handle: IOHandle) -> IOHandle:
        self._handles = [h for h in self._handles if not h.done()] + [handle]
        return handle


def _stale_reason(d: Path, host: str, now: float) -> str | None:
    """Why the rank directory `d` is stale, or None to keep it."""
    try:
        owner = json.loads((d / OWNER_FILE).read_text())
        o_host, pid, created = str(owner["hostname"]), int(owner["pid"]), float(owner["created"])
    except (OSError, ValueError, KeyError, TypeError):
        age = now - d.stat().st_mtime
        return f"no readable {OWNER_FILE}, {age / 3600:.1f} h old" if age > STALE_UNOWNED_SECONDS else None
    if o_host != host:
        return None  # only that host can tell whether its process lives
    if not psutil.pid_exists(pid):
        return f"pid {pid} is not running"
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return f"pid {pid} is not running"
    except psutil.Error:
        return None  # cannot tell: keep
    if started > created + PID_REUSE_SLACK:
        return f"pid {pid} now belongs to a process started after the directory was made"
    return None


def clear_stale(nvme_path: str | os.PathLike) -> list[Path]:
    """Remove swap directories under <nvme_path>/zerospeed_swap left by runs that no longer exist.

    Stale: OWNER.json names this host and a pid that is not running, or running but started after OWNER's
    `created` (the pid was reused); or OWNER.json is missing/unreadable and the directory is over an hour old.
    Other hosts' directories and this process's open SwapSpaces are kept. Logs one warning per removal with the
    bytes freed; returns the removed paths. Directories that cannot be removed are logged and skipped.
    """
    base = Path(nvme_path).resolve() / SWAP_DIR_NAME
    if not base.is_dir():
        return []
    host, now, removed = socket.gethostname(), time.time(), []
    with _open_lock:
        own = set(_open_dirs)
    for d in sorted(base.iterdir()):
        if not d.is_dir() or d.is_symlink() or d in own:
            continue
        try:
            reason = _stale_reason(d, host, now)
        except OSError:
            continue  # vanished meanwhile (another rank cleaned it)
        if reason is None:
            continue
        freed = _dir_bytes(d)
        shutil.rmtree(d, ignore_errors=True)
        if d.exists():
            logger.warning(f"could not remove stale swap directory {d} ({reason}); remove it by hand")
            continue
        logger.warning(f"removed stale swap directory {d} ({reason}): freed {format_bytes(freed)}")
        removed.append(d)
    return removed


class BufferPool:
    """`count` aligned HOST buffers of `numel` elements of `dtype` each (pinned if pin and an accelerator exists).

    `name` is the config key that sizes a buffer (e.g. "offload_param.buffer_size"), used in messages.
    Thread-safe. nbytes = count * numel * itemsize (the alignment slack of each buffer is not counted).
    """

    def __init__(self, count: int, numel: int, dtype: torch.dtype, *, pin: bool = False, name: str = "buffer"):
        if count < 1 or numel < 1:
            raise ValueError(f"{name}: a buffer pool needs count >= 1 and numel >= 1, got count={count}, "
                             f"numel={numel}")
        self.count, self.numel, self.dtype, self.name = count, numel, dtype, name
        self._buffers = [aligned_empty(numel, dtype, pin=pin) for _ in range(count)]
        self._index = {b.untyped_storage().data_ptr(): i for i, b in enumerate(self._buffers)}
        self._free = list(range(count - 1, -1, -1))  # pop() hands out buffer 0 first
        self._lock = threading.Lock()

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.count * self.numel * self.dtype.itemsize

    def acquire(self, numel: int) -> torch.Tensor:
        """A 1-D view of the first `numel` elements of a free buffer (data_ptr aligned). Raises ValueError if
        numel is negative or exceeds the buffer size, RuntimeError if every buffer is in use."""
        if numel < 0 or numel > self.numel:
            raise ValueError(f"{self.name}: asked for a buffer of {numel} elements but each buffer holds "
                             f"{self.numel}; raise {self.name} to at least {numel}")
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {self.count} swap buffers are in use ({self.name} = {self.numel} "
                                   f"elements each): release one first or raise buffer_count")
            return self._buffers[self._free.pop()][:numel]

    def release(self, view: torch.Tensor) -> None:
        """Return the buffer `view` came from. Raises ValueError for a tensor not from this pool or a buffer
        that is already free."""
        i = self._index.get(view.untyped_storage().data_ptr())
        if i is None:
            raise ValueError(f"{self.name}: this tensor is not a buffer of this pool")
        with self._lock:
            if i in self._free:
                raise ValueError(f"{self.name}: buffer {i} was released twice")
            self._free.append(i)
