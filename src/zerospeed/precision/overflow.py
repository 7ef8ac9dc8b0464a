"""Overflow bookkeeping shared by the strategies and the engine.

How ranks agree (no extra collective): a strategy's `clip_and_norm` all-reduces the sum of squares
of the (unscaled) gradients over the data-parallel group. A non-finite element anywhere on any
rank makes that sum inf or nan on *every* rank (squares are >= 0, so inf never cancels), hence
`not math.isfinite(norm)` is the same decision everywhere: the overflow flag rides in the norm's
all-reduce. At stage 0 the gradients are all-reduced already, so every rank sees the same inf/nan.

`first_nonfinite` names the culprits for the error at the minimum loss scale (a collective at
stages >= 1, where each rank sees only its partition). `SkipLog` writes one line per N skipped
steps instead of DeepSpeed's line per overflow (pain point #8: "endless OVERFLOW logs").
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("zerospeed.precision")

OVERFLOW_LOG_EVERY = 10  # skipped steps per log line (the first skip is always logged)


def is_nonfinite(t: torch.Tensor) -> bool:
    """True if `t` holds an inf or nan."""
    return t.numel() > 0 and not bool(torch.isfinite(t).all())


def first_nonfinite(local: list[tuple[int, str]], *, group: dist.ProcessGroup | None, limit: int = 5,
                    collective: bool = True) -> list[str]:
    """Merge the (order key, parameter name) pairs each rank found with non-finite gradients and
    return the first `limit` names in parameter order. collective=True: all-gathers over `group`
    (call on every rank); False: only this rank's list (stage 0, where gradients are identical)."""
    found = list(local)
    if collective and dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, found, group=group)
        found = [item for part in everyone for item in part]
    names: list[str] = []
    for _, name in sorted(set(found)):
        if name not in names:
            names.append(name)
    return names[:limit]


class SkipLog:
    """Rate-limited log of skipped steps: the first skip, then one line per `every` skips.

    rank: only rank 0 writes (every rank skips together, so one line says it all)."""

    def __init__(self, *, rank: int, every: int = OVERFLOW_LOG_EVERY):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.rank, self.every = rank, every
        self.lines = 0

    def skipped(self, *, step: int, total_skipped: int, old_scale: float, new_scale: float, fp16: bool) -> bool:
        """Record a skipped step; returns True if a line was written."""
        if self.rank != 0 or (total_skipped - 1) % self.every:
            return False
        scale = f"; fp16 loss scale {old_scale:g} -> {new_scale:g}" if fp16 else ""
        rest = f" (logging 1 line per {self.every} skipped steps)" if total_skipped == 1 else ""
        log.warning("step %d: gradient overflow (inf/nan) on at least one rank: optimizer step skipped on every "
                    "rank, %d skipped so far%s%s", step, total_skipped, scale, rest)
        self.lines += 1
        return True
