"""Bucket plans: pure functions that group parameters into flat communication buckets.

A plan only says which parameter goes where; runners (`data_parallel.py`, the ZeRO stages) own
the buffers and the collectives. Tested without processes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketSlot:
    """Parameter `index` occupies elements [offset, offset + numel) of bucket `bucket`."""

    index: int
    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketPlan:
    """Buckets in launch order; `sizes[b]` is bucket b's length in elements."""

    slots: tuple[BucketSlot, ...]
    sizes: tuple[int, ...]

    def members(self, bucket: int) -> list[BucketSlot]:
        return [s for s in self.slots if s.bucket == bucket]


def plan_buckets(numels: list[int], bucket_size: int, *, reverse: bool = True) -> BucketPlan:
    """Group parameters (given by element counts, in module registration order) into buckets.

    Parameters are taken in reverse order by default, the order backward produces gradients in,
    so the first bucket fills first (as in PyTorch DDP, Li et al. 2020, §3.2.3). A bucket is closed
    once it holds at least `bucket_size` elements; a parameter larger than `bucket_size` gets a
    bucket of its own. Raises ValueError if bucket_size < 1.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
    order = range(len(numels) - 1, -1, -1) if reverse else range(len(numels))
    slots: list[BucketSlot] = []
    sizes: list[int] = []
    fill = 0
    for i in order:
        n = numels[i]
        if fill and fill + n > bucket_size:
            sizes.append(fill)
            fill = 0
        slots.append(BucketSlot(i, len(sizes), fill, n))
        fill += n
    if fill or not sizes:
        sizes.append(fill)
    return BucketPlan(tuple(slots), tuple(sizes))
