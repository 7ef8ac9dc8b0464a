"""Comms logger: counts calls, bytes and time per collective (DeepSpeed's `comms_logger` block)."""
from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class OpStats:
    """Totals for one collective name: calls, bytes and elements sent in, seconds from start to finish."""

    calls: int = 0
    bytes: int = 0
    elements: int = 0
    seconds: float = 0.0


_LIVE: "weakref.WeakSet[CommsLogger]" = weakref.WeakSet()  # every logger alive, for `comm.log_summary()`


@dataclass(eq=False)
class CommsLogger:
    """Accumulates per-collective statistics.

    enabled: record anything at all. verbose: log every call. prof_all / prof_ops: record all ops, or
    only the names listed. Counts are what this rank passes to the collective (input elements).
    calls: per op and message size (bytes), each call's (seconds, ranks in its group): what DeepSpeed's
    `comm.log_summary()` tabulates (`comm/summary.py`).
    """

    enabled: bool = True
    verbose: bool = False
    prof_all: bool = True
    prof_ops: tuple[str, ...] = ()
    stats: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    calls: dict[str, dict[int, list[tuple[float, int]]]] = field(default_factory=dict)

    def __post_init__(self):
        _LIVE.add(self)

    def wants(self, name: str) -> bool:
        return self.enabled and (self.prof_all or name in self.prof_ops)

    def record(self, name: str, numel: int, nbytes: int, seconds: float, ranks: int = 1) -> None:
        if not self.wants(name):
            return
        s = self.stats[name]
        s.calls += 1
        s.bytes += nbytes
        s.elements += numel
        s.seconds += seconds
        self.calls.setdefault(name, {}).setdefault(nbytes, []).append((seconds, ranks))
        if self.verbose:
            log.info("comm %s: %d elements, %d bytes, %.3f ms", name, numel, nbytes, seconds * 1e3)

    def total_elements(self) -> int:
        return sum(s.elements for s in self.stats.values())

    def reset(self) -> None:
        self.stats.clear()
        self.calls.clear()

    def summary(self) -> str:
        """A table: op, calls, MB, ms, MB/s."""
        rows = [f"{'op':<16}{'calls':>8}{'MB':>12}{'ms':>12}{'MB/s':>10}"]
        for name, s in sorted(self.stats.items()):
            mb = s.bytes / 2**20
            rows.append(f"{name:<16}{s.calls:>8}{mb:>12.2f}{s.seconds * 1e3:>12.1f}"
                        f"{(mb / s.seconds if s.seconds else 0.0):>10.1f}")
        return "\n".join(rows)


def live_loggers() -> list[CommsLogger]:
    """The loggers alive in this process (one per engine built with `comms_logger.enabled`)."""
    return list(_LIVE)
