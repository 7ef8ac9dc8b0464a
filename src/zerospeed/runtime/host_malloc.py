"""Keep freed host memory for reuse, so a training step on the host does not fault its pages in again.

A training step allocates and frees the same activations and gradients every micro-batch. glibc's malloc
gives memory back to the kernel when it can: a block above its mmap threshold (128 KiB at first, raised
dynamically to the largest block freed so far, at most 32 MiB on 64-bit) is its own mapping, unmapped on
free; free space above the trim threshold (2x that) at the top of the heap is returned with `brk`. The
next micro-batch then touches fresh pages, and every 4 KiB page costs a fault and a zeroing. Measured on
this CPU (one process, 4 GPT blocks at d 384, seq 256, bf16, 4 sequences): the forward took ~9,000 minor
page faults and a backward split into input- and weight-gradient passes (`pipe.backward_split`, whose first
pass keeps the graph alive for the second, so the heap's top moves every micro-batch) ~12,000; with the
thresholds below, none, and the split backward went from 257 ms to 240 ms (fused: 233 ms either way). The
engine step of an 8-layer MLP at bf16, ZeRO 2, split: 1.11-1.13x the fused step's time before, 1.03-1.06x after
(3 processes each, interleaved); a 2-stage GPT pipeline (bf16, zb_v): 6,500-16,000 faults per step and rank
before, a few hundred after, its step time within this machine's noise (4 interleaved pairs, median 1.00x).

What it does: `mallopt(M_MMAP_THRESHOLD, 32 MiB)` (blocks up to that come from the heap, as glibc's own
dynamic rule would allow after freeing one) and `mallopt(M_TRIM_THRESHOLD, 1 GiB)` (free heap is kept up to
that, not returned). The price: the resident set stays near its peak instead of shrinking between steps
(the peak itself is unchanged: the memory is reused, not added). Process-wide and permanent, as the
allocator is; on other C libraries (musl, macOS, Windows), under an allocator preloaded in glibc's place
(jemalloc, tcmalloc: they do not read glibc's settings), or when the user set glibc's own knobs
(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`, `MALLOC_MMAP_MAX_`, `GLIBC_TUNABLES` with
`malloc`), nothing is changed. Blocks above 32 MiB stay mappings of their own; `MALLOC_MMAP_MAX_=0` in the
environment removes those too (measured: in-memory ZeRO-3 fp32 at width 2048, 0.58x the step time, +40-70%
peak RSS from heap fragmentation; bench/README.md, session 29), which is why it is the user's choice.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

import torch

from ..profiling.peak import is_accelerator

__all__ = ["retain_freed_host_memory", "retain_wanted", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

log = logging.getLogger(__name__)

#: bytes: blocks up to this size come from the heap (glibc's own upper bound for its dynamic threshold)
MMAP_THRESHOLD = 32 << 20
#: bytes of free memory kept at the top of the heap before any is returned to the kernel
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_applied: bool | None = None


def _user_tuned() -> str | None:
    """The environment variable by which the user already tuned glibc's malloc, or None."""
    for name in _USER_KNOBS:
        if name in os.environ:
            return name
    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def retain_wanted(cfg, device: torch.device) -> bool:
    """The config's `retain_freed_host_memory` resolved (`cfg` a ZeroSpeedConfig): "auto" = the model trains on the
    host (`device` is no accelerator) and nothing is offloaded (offload runs budget host memory, issue 22)."""
    retain = cfg.retain_freed_host_memory
    if retain != "auto":
        return retain
    zero = cfg.zero_optimization
    offloaded = any(o is not None and o.device != "none" for o in (zero.offload_param, zero.offload_optimizer))
    return not is_accelerator(device) and not offloaded


def retain_freed_host_memory() -> bool:
    """Set glibc malloc's mmap threshold to `MMAP_THRESHOLD` and trim threshold to `TRIM_THRESHOLD` bytes, once
    per process (see the module docstring). Returns whether they are set (False: not glibc, or the user tuned
    malloc through the environment; nothing changed). Never raises."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    knob = _user_tuned()
    if knob is not None:
        log.debug("host malloc left as the user tuned it (%s)", knob)
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
