"""Pre-flight checks for offload, run before anything is allocated: is nvme_path usable, and do host RAM, the
locked-memory limit and the disks hold what the ranks of this node will need? Each failure says the numbers and
the fix, instead of an OOM kill or ENOSPC an hour into training."""
from __future__ import annotations

import os
import resource
import shutil
import uuid
from pathlib import Path

import psutil


class OffloadResourceError(RuntimeError):
    """Not enough host RAM / pinned memory / disk, or a bad nvme_path: the message has the numbers and the fix."""


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int) -> str:
    """A byte count in binary units, two decimals above bytes: 512 -> "512 B", 1536 -> "1.50 KiB",
    3 * 2**30 // 2 -> "1.50 GiB". (profiling.format.bytes_to_string prints decimal units for the flops
    profiler's DeepSpeed-compatible report; RAM, memlock and disk sizes read better in binary units.)"""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(n)} B" if unit == 0 else f"{value:.2f} {_UNITS[unit]}"


def check_nvme_path(path: str | os.PathLike | None, *, key: str) -> Path:
    """Check that `path` is an existing, writable directory and return it resolved.

    `key` is the config key for messages, e.g. "zero_optimization.offload_optimizer.nvme_path". Writability is
    checked with os.access and by creating and removing a probe file. Raises OffloadResourceError when the path
    is unset, missing, not a directory or not writable.
    """
    if path is None or str(path) == "":
        raise OffloadResourceError(f"{key} is not set: point it at a directory on your NVMe drive")
    p = Path(path).expanduser()
    if not p.exists():
        raise OffloadResourceError(f"{key} = {str(path)!r} does not exist; create it (mkdir -p {p}) or point {key} "
                                   "at a directory on your NVMe drive")
    if not p.is_dir():
        raise OffloadResourceError(f"{key} = {str(path)!r} is not a directory; point {key} at a directory on your "
                                   "NVMe drive")
    problem = None
    if not os.access(p, os.W_OK | os.X_OK):
        problem = "no write permission"
    else:
        probe = p / f".zerospeed-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            problem = f"creating a file there failed: {e.strerror or e}"
    if problem:
        raise OffloadResourceError(f"{key} = {str(path)!r} is not writable ({problem}); fix its permissions "
                                   f"(chmod u+w {p}) or point {key} at a writable directory on your NVMe drive")
    return p.resolve()


def _existing(path: Path) -> Path:
    """`path` or its nearest existing ancestor (the file system it will live on)."""
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_resources(*, host_bytes: int = 0, pinned_bytes: int = 0, disk_bytes: dict | None = None,
                    local_ranks: int = 1, what: str = "offload", disk_credit: dict | None = None) -> None:
    """Raise OffloadResourceError, naming every shortfall with needed vs available and the fix, when this node
    cannot hold what its ranks will allocate. Call before allocating anything.

    host_bytes: pageable host RAM and pinned_bytes: page-locked host RAM THIS rank will allocate (separate
    amounts, both count against RAM); disk_bytes: {directory: bytes this rank will write there}. The node needs
    local_ranks times each (ranks of a node share RAM and disks): host + pinned against
    psutil.virtual_memory().available, and per file system (paths with the same st_dev are summed) against
    shutil.disk_usage(path).free. pinned_bytes of ONE rank is compared with the RLIMIT_MEMLOCK soft limit,
    which is per process (skipped when unlimited or pinned_bytes is 0). `what` names the feature in the message.
    disk_credit: {path: bytes} THIS rank already wrote there and the run frees as it starts (the slices of
    `zero.Init(remote_device="nvme")`, deleted as the strategy takes them over): local_ranks times that
    is counted as free.
    Raises ValueError for negative sizes or local_ranks < 1.
    """
    disk_bytes = dict(disk_bytes or {})
    if local_ranks < 1 or min([host_bytes, pinned_bytes, *disk_bytes.values()]) < 0:
        raise ValueError(f"check_resources needs sizes >= 0 and local_ranks >= 1, got host_bytes={host_bytes}, "
                         f"pinned_bytes={pinned_bytes}, disk_bytes={disk_bytes}, local_ranks={local_ranks}")
    per = f" ({local_ranks} local ranks x {{}} each)" if local_ranks > 1 else ""
    short = []
    ram = (host_bytes + pinned_bytes) * local_ranks
    if ram:
        available = psutil.virtual_memory().available
        if ram > available:
            short.append(f"host RAM: needs {format_bytes(ram)}{per.format(format_bytes(ram // local_ranks))} but "
                         f"{format_bytes(available)} is available; free memory, lower sub_group_size or "
                         "buffer_count, or offload to nvme instead of cpu")
    if pinned_bytes:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and pinned_bytes > soft:
            short.append(f"pinned memory: each rank pins {format_bytes(pinned_bytes)} but the locked-memory limit "
                         f"(ulimit -l) is {format_bytes(soft)}; raise it (ulimit -l unlimited, or memlock in "
                         "/etc/security/limits.conf; docker run --ulimit memlock=-1), set pin_memory: false, or "
                         "lower buffer_count / buffer_size")
    by_device: dict[int, list] = {}
    for path, n in disk_bytes.items():
        where = _existing(Path(path))
        entry = by_device.setdefault(os.stat(where).st_dev, [where, [], 0])
        entry[1].append(str(path))
        entry[2] += n
    credit: dict[int, int] = {}
    for path, n in (disk_credit or {}).items():
        dev = os.stat(_existing(Path(path))).st_dev
        credit[dev] = credit.get(dev, 0) + n * local_ranks
    for dev, (where, paths, n) in by_device.items():
        need = n * local_ranks
        free = shutil.disk_usage(where).free + credit.get(dev, 0)
        if need > free:
            short.append(f"disk at {', '.join(paths)}: needs {format_bytes(need)}"
                         f"{per.format(format_bytes(n))} but {format_bytes(free)} is free; free disk space or "
                         "point nvme_path at a drive with more room")
    if short:
        raise OffloadResourceError(f"not enough resources for {what}:\n  - " + "\n  - ".join(short))
