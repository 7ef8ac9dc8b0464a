"""Uniform contiguous partitions: the boundaries of `num_parts` runs of `num_items` items. Pure."""
from __future__ import annotations

__all__ = ["partition_uniform"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Split `num_items` items into `num_parts` contiguous parts whose sizes differ by at most one, the
    larger parts first. Returns the num_parts + 1 boundaries (part p is `[parts[p], parts[p + 1])`). With
    num_items <= num_parts, part p holds item p and the parts past num_items are empty (DeepSpeed:
    `parts[p] = min(p, num_items)`).

    Source: DeepSpeed 0.19.8 `deepspeed/runtime/utils.py: partition_uniform` (its pipeline stages and
    `TiledLinear` tiles). Example: (10, 4) -> [0, 3, 6, 8, 10]. Raises ValueError if num_parts < 1 or
    num_items < 0.
    """
    if num_parts < 1 or num_items < 0:
        raise ValueError(f"partition_uniform: need num_parts >= 1 and num_items >= 0, got num_items={num_items}, "
                         f"num_parts={num_parts}")
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]
