"""Collectives as named start/finish pairs, each profiled and counted.

Every call runs inside `torch.profiler.record_function("zerospeed::<op>")` and is counted by the
optional `CommsLogger` (calls, elements, bytes, seconds from start to the end of `wait()`).
Process groups are always arguments.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .logger import CommsLogger


@dataclass
class CommHandle:
    """An in-flight collective; `wait()` finishes it (idempotent)."""

    name: str
    work: dist.Work | None
    numel: int
    nbytes: int
    started: float
    logger: CommsLogger | None
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        with record_function(f"zerospeed::{self.name}.wait"):
            if self.work is not None:
                self.work.wait()
        self.done = True
        if self.logger is not None:
            self.logger.record(self.name, self.numel, self.nbytes, time.perf_counter() - self.started)


def _handle(name, work, tensor, logger, started):
    h = CommHandle(name, work, tensor.numel(), tensor.numel() * tensor.element_size(), started, logger)
    return h


def start_all_reduce(tensor: torch.Tensor, *, group: dist.ProcessGroup | None,
                     op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                     logger: CommsLogger | None = None) -> CommHandle:
    """Start an in-place all-reduce of `tensor` over `group`; finish with `.wait()`."""
    started = time.perf_counter()
    with record_function("zerospeed::all_reduce"):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return _handle("all_reduce", work, tensor, logger, started)


def all_reduce(tensor: torch.Tensor, *, group: dist.ProcessGroup | None,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, logger: CommsLogger | None = None) -> torch.Tensor:
    """Blocking in-place all-reduce; returns `tensor`."""
    start_all_reduce(tensor, group=group, op=op, logger=logger).wait()
    return tensor


def broadcast(tensor: torch.Tensor, src: int, *, group: dist.ProcessGroup | None,
              logger: CommsLogger | None = None) -> torch.Tensor:
    """Blocking in-place broadcast from global rank `src`; returns `tensor`."""
    started = time.perf_counter()
    with record_function("zerospeed::broadcast"):
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    _handle("broadcast", work, tensor, logger, started).wait()
    return tensor
