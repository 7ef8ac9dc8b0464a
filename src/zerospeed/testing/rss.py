"""Resident-memory probes for tests (Linux /proc): what building something added to the peak RSS."""
from __future__ import annotations

from typing import Any, Callable

from ..offload.hostmem import smaps_field  # noqa: F401 - the tests read it from here too


def rss_bytes(key: str = "VmRSS:") -> int:
    """A /proc/self/status field in bytes: "VmRSS:" (resident now) or "VmHWM:" (peak since the last reset)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS ("5" into /proc/self/clear_refs). False where that is not
    possible (not Linux, no permission)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_growth(build: Callable[[], Any]) -> tuple[Any, int]:
    """(build(), peak resident bytes added while building): VmHWM after resetting it (clear_refs 5).
    Raises OSError where the peak cannot be reset."""
    before = rss_bytes("VmRSS:")
    if not reset_peak_rss():
        raise OSError("cannot reset the peak RSS (/proc/self/clear_refs): peak_growth needs Linux")
    out = build()
    return out, rss_bytes("VmHWM:") - before


def huge_page_bytes(tensor) -> int:
    """Bytes of transparent huge pages (/proc/self/smaps "AnonHugePages") in the memory mappings that overlap
    `tensor`'s storage: whole mappings, so neighbours sharing a mapping count too. 0 where smaps is missing."""
    storage = tensor.untyped_storage()
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    total, overlaps = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    overlaps = start < hi and lo < end
                elif overlaps and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total

