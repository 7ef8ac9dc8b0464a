"""Device helpers for the profiler: accelerator synchronisation and a measured matmul peak.

The peak is what model FLOPs utilisation (MFU) is measured against when no datasheet number is
given: the best sustained rate of large square matmuls on this device, in FLOP/s.
"""
from __future__ import annotations

import math
import time

import torch

_peak_cache: dict[tuple[str, str, int], float] = {}


def default_device() -> torch.device:
    """The current accelerator if one is available, else torch's default device."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device(acc) if acc is not None else torch.get_default_device()


def is_accelerator(device: torch.device | None) -> bool:
    """True if `device` is of the current accelerator's type (so timers need a synchronize)."""
    if device is None or not torch.accelerator.is_available():
        return False
    return device.type == torch.accelerator.current_accelerator().type


def sync(device: torch.device | None) -> None:
    """Wait for queued work on `device` if it is an accelerator; no-op for host devices."""
    if is_accelerator(device):
        torch.accelerator.synchronize(device)


def measure_matmul_peak_flops(dtype: torch.dtype = torch.float32, n: int = 1024,
                              device: torch.device | str | None = None, *, repeats: int = 3,
                              min_seconds: float = 0.05) -> float:
    """Measure the achievable dense matmul throughput of one device, in FLOP/s.

    Times `n x n @ n x n` products (2 n^3 FLOPs each) of `dtype` on `device` (default: the current
    accelerator, else the default device), `repeats` trials of at least `min_seconds` each, and
    returns the best trial. Used as the "peak" for model FLOPs utilisation (MFU) when no
    datasheet peak is given. Raises ValueError if n < 1 or repeats < 1.
    """
    if n < 1 or repeats < 1:
        raise ValueError(f"need n >= 1 and repeats >= 1, got n={n}, repeats={repeats}")
    device = torch.device(device) if device is not None else default_device()
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
    out = torch.empty(n, n, dtype=dtype, device=device)
    flops_per_mm = 2.0 * n ** 3
    torch.matmul(a, b, out=out)  # warm-up (kernel selection, page faults)
    sync(device)
    t0 = time.perf_counter()
    torch.matmul(a, b, out=out)
    sync(device)
    iters = max(1, math.ceil(min_seconds / max(time.perf_counter() - t0, 1e-9)))
    best = 0.0
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b, out=out)
        sync(device)
        best = max(best, flops_per_mm * iters / max(time.perf_counter() - t0, 1e-12))
    return best


def cached_peak_flops(dtype: torch.dtype, device: torch.device) -> float:
    """measure_matmul_peak_flops(dtype, 1024, device), measured once per process and reused."""
    key = (str(dtype), str(device), 1024)
    if key not in _peak_cache:
        _peak_cache[key] = measure_matmul_peak_flops(dtype, 1024, device)
    return _peak_cache[key]
