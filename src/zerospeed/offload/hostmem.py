"""Give freed host memory back to the OS, so offload's RAM savings show up as a lower RSS.

glibc serves allocations below its mmap threshold from the heap and raises that threshold (up to
32 MiB) each time a larger mmapped block is freed; freeing the full-size copies of a model while
ZeRO-3 shards it, or gradient and I/O buffers of a few MiB per step, then leaves hundreds of MiB of
free-but-resident heap (measured here: 1.63 GB peak RSS instead of 1.06 GB for a 151M-parameter
GPT with NVMe offload at world size 2). Fixing the threshold at 1 MiB keeps every tensor-sized
block in its own mapping, returned to the OS when freed. No-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["return_freed_memory_to_os"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def return_freed_memory_to_os(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Process-wide: mmap every allocation of `threshold` bytes or more, and release free heap pages
    now (malloc_trim). Returns False where this is not glibc (nothing changed)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    libc.malloc_trim(0)
    return ok
