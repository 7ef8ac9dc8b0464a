"""The one queue of in-flight gradient reductions, shared by every ZeRO stage.

A stage starts a bucket's collective (all-reduce at stage 0, reduce-scatter at stages 1-3) and
pushes its handle with a callback that consumes the result (copy back, divide, accumulate into the
partition gradient). Reductions finish strictly in the order they started, so every rank consumes
the same results in the same order and the sums are rounded identically on every run.

The bound: each reduction in flight holds its input bucket (and, on gloo's point-to-point
reduce-scatter, a receive buffer of (N-1)/N of it) until its `wait()`. With `max_in_flight = m`,
pushing the (m+1)-th blocks on the oldest, so a backward reuses a few buckets' worth of memory
instead of holding one per bucket (stages 1-2: `MAX_CHUNKS_IN_FLIGHT`; stage 3: its bucket bound);
`None` keeps every reduction until `wait_all` (stage 0, as PyTorch DDP: its buckets are the
gradients themselves, nothing is freed early). `finish_early` also finishes, at each push, the
oldest reductions that have already completed (never blocking), so their buffers are reused sooner.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from .ops import CommHandle


class ReduceQueue:
    """Started reductions, finished in start order, at most `max_in_flight` outstanding after a push.

    max_in_flight: the bound (>= 1), or None for none. finish_early: finish completed reductions at
    each push (see the module docstring). `peak` is the most reductions in flight at once so far
    (right after a push, before it finishes any: at most max_in_flight + 1). Raises ValueError for a
    bound below 1.
    """

    def __init__(self, max_in_flight: int | None, *, finish_early: bool = False):
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 or None, got {max_in_flight}")
        self.max_in_flight, self.finish_early = max_in_flight, finish_early
        self._queue: deque[tuple[CommHandle, Callable[[], None]]] = deque()
        self.peak = 0

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, handle: CommHandle, on_done: Callable[[], None]) -> None:
        """Add a started reduction; `on_done()` runs right after its `wait()`. Then finish the oldest
        ones while more than `max_in_flight` are in flight (blocking) or, with finish_early, while the
        oldest has completed."""
        self._queue.append((handle, on_done))
        self.peak = max(self.peak, len(self._queue))
        self.drain()

    def drain(self) -> None:
        """Finish the oldest reductions while over the bound or (finish_early) already completed."""
        bound = self.max_in_flight
        while self._queue and ((bound is not None and len(self._queue) > bound)
                               or (self.finish_early and self._queue[0][0].is_completed())):
            self._finish_oldest()

    def wait_all(self) -> None:
        """Finish every reduction in flight, oldest first."""
        while self._queue:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        handle, on_done = self._queue.popleft()
        handle.wait()
        on_done()
