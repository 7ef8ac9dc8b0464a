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
    work: "dist.Work | Works | None"
    numel: int
    nbytes: int
    started: float
    logger: CommsLogger | None
    done: bool = False
    group: object = None  # its process group (the logger records the group's size)

    def wait(self) -> None:
        if self.done:
            return
        with record_function(f"zerospeed::{self.name}.wait"):
            if self.work is not None:
                self.work.wait()
        self.work = None  # a finished dist.Work still references its tensors: let them go now
        self.done = True
        if self.logger is not None:
            self.logger.record(self.name, self.numel, self.nbytes, time.perf_counter() - self.started,
                               dist.get_world_size(self.group))

    def is_completed(self) -> bool:
        """True once the collective finished (`wait()` then returns at once); never blocks."""
        return self.done or self.work is None or self.work.is_completed()


class Works:
    """Several `dist.Work` finished as one (the point-to-point messages of one collective: `_messages`)."""

    def __init__(self, works: list[dist.Work]):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _point_to_point(group) -> bool:
    """True on gloo, where an all-gather and a reduce-scatter run faster as point-to-point messages
    (`_messages`; measured, gloo, 1 thread per rank, medians of 15: all-gather 0.83-0.87x the time of
    one broadcast per source rank at 2 ranks and 0.83-0.94x at 4, 0.4-1.85M fp32 elements per rank,
    while `all_gather_into_tensor` is 1.3-2.7x slower than the broadcasts: it gathers into a new flat
    tensor and copies it out; reduce-scatter: see `start_reduce_scatter`)."""
    return dist.get_backend(group) == dist.Backend.GLOO


_ALL_GATHER_TAG, _REDUCE_SCATTER_TAG = 1, 2  # messages of the two kinds are never matched to each other


def _messages(group, send, recv, tag: int) -> Works:
    """One isend to and one irecv from every other rank: message j (1 <= j < N) goes to rank + j and
    comes from rank - j. send(dst) / recv(j, src) return the contiguous tensors. Every rank posts the
    same sequence of operations, and gloo matches messages of one (pair, tag) in posting order."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    works = []
    for j in range(1, world):
        dst, src = (rank + j) % world, (rank - j) % world
        works.append(dist.isend(send(dst), group=group, group_dst=dst, tag=tag))
        works.append(dist.irecv(recv(j, src), group=group, group_src=src, tag=tag))
    return Works(works)


def _handle(name, work, tensor, logger, started, group):
    return CommHandle(name, work, tensor.numel(), tensor.numel() * tensor.element_size(), started, logger,
                      group=group)


def start_all_reduce(tensor: torch.Tensor, *, group: dist.ProcessGroup | None,
                     op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                     logger: CommsLogger | None = None) -> CommHandle:
    """Start an in-place all-reduce of `tensor` over `group`; finish with `.wait()`."""
    started = time.perf_counter()
    with record_function("zerospeed::all_reduce"):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return _handle("all_reduce", work, tensor, logger, started, group)


def all_reduce(tensor: torch.Tensor, *, group: dist.ProcessGroup | None,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, logger: CommsLogger | None = None) -> torch.Tensor:
    """Blocking in-place all-reduce; returns `tensor`."""
    start_all_reduce(tensor, group=group, op=op, logger=logger).wait()
    return tensor


def broadcast(tensor: torch.Tensor, src: int, *, group: dist.ProcessGroup | None,
              logger: CommsLogger | None = None) -> torch.Tensor:
    """Blocking in-place broadcast from `src`, the source's rank *in `group`* (its global rank only when
    group is None, the world), as every other rank argument here; returns `tensor`."""
    started = time.perf_counter()
    with record_function("zerospeed::broadcast"):
        work = dist.broadcast(tensor, group_src=src, group=group, async_op=True)
    _handle("broadcast", work, tensor, logger, started, group).wait()
    return tensor


def start_send(tensor: torch.Tensor, dst: int, *, group: dist.ProcessGroup | None,
               logger: CommsLogger | None = None) -> CommHandle:
    """Start a point-to-point send of `tensor` to `dst`, its rank in `group`; finish with `.wait()` (the
    tensor must not change before). Counted as "send" (tensor.numel() elements)."""
    started = time.perf_counter()
    with record_function("zerospeed::send"):
        work = dist.isend(tensor, group=group, group_dst=dst)
    return _handle("send", work, tensor, logger, started, group)


def start_recv(tensor: torch.Tensor, src: int, *, group: dist.ProcessGroup | None,
               logger: CommsLogger | None = None) -> CommHandle:
    """Start a point-to-point receive into `tensor` from `src`, its rank in `group`; `tensor` holds the
    message after `.wait()`. Posting it early lets the transfer run while this rank computes (gloo moves an
    unbound-buffer message once the receive is posted). Counted as "recv"."""
    started = time.perf_counter()
    with record_function("zerospeed::recv"):
        work = dist.irecv(tensor, group=group, group_src=src)
    return _handle("recv", work, tensor, logger, started, group)


def recv(tensor: torch.Tensor, src: int, *, group: dist.ProcessGroup | None,
         logger: CommsLogger | None = None) -> torch.Tensor:
    """Blocking point-to-point receive into `tensor` from `src`, its rank in `group`; returns `tensor`.
    Counted as "recv"."""
    start_recv(tensor, src, group=group, logger=logger).wait()
    return tensor


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None,
                      logger: CommsLogger | None = None, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None) -> torch.Tensor:
    """Blocking all-to-all along dim 0: `input` is cut into N chunks (N ranks in `group`; equal ones, or
    `input_split_sizes` rows each), chunk j goes to rank j, and the chunk from rank i lands in `output` at
    chunk i (equal, or `output_split_sizes` rows each: what rank i sends this rank). Returns `output`.
    Counted as "all_to_all" (`input.numel()` elements)."""
    started = time.perf_counter()
    with record_function("zerospeed::all_to_all"):
        work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                      async_op=True)
    _handle("all_to_all", work, input, logger, started, group).wait()
    return output


# recent torch names the single-tensor collectives *_single (the *_tensor / *_into_tensor names are deprecated)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def start_reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None,
                         op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                         logger: CommsLogger | None = None, input_is_scratch: bool = False,
                         workspace: torch.Tensor | None = None) -> CommHandle:
    """Start a reduce-scatter: `input` ([N * k] elements, the same length on every rank) is summed over
    `group` and rank r receives elements [r*k, (r+1)*k) in `output` ([k]). `output` may be that very
    slice of `input` (in place). Counted as `input.numel()` elements. Finish with `.wait()`.

    input_is_scratch: the caller no longer needs `input` (its other slices are left undefined). On
    gloo, whose reduce-scatter is a clone of the input + a ring all-reduce (2(N-1)k elements sent per
    rank) + a copy out, a SUM into this rank's own slice then runs as point-to-point messages: slice j
    of `input` is sent to rank j and the N-1 slices for this rank are received into a [(N-1) * k]
    buffer ((N-1)k elements sent: the textbook reduce-scatter volume, half the all-reduce's); `wait()`
    adds them into `output` (its own slice first, then the others in a fixed order). Measured (gloo, 1
    thread per rank, medians of 15): 0.79x the time of an all-to-all into an [N * k] buffer at 1.85M
    fp32 elements and 2 ranks, 0.5x at 0.4M; and gloo's all-to-all keeps a (N-1)k-element buffer of
    its own after it finished, the messages nothing. Still counted and profiled as this
    reduce-scatter; the summation happens inside its `.wait`.

    workspace: where that path receives: a contiguous tensor of at least (N-1)k elements of `input`'s
    dtype and device, the caller's until `.wait()` returns (None: allocated here). Reusing one saves
    the kernel's zeroing of fresh pages on the host: a new (N-1)k buffer per bucket costs more than the
    sum that reads it (bench/README.md, session 29)."""
    started = time.perf_counter()
    with record_function("zerospeed::reduce_scatter"):
        if (input_is_scratch and op == dist.ReduceOp.SUM and _point_to_point(group)
                and _is_own_slice(output, input, group)):
            world, k = dist.get_world_size(group), output.numel()
            if workspace is None:
                received = torch.empty((world - 1) * k, dtype=input.dtype, device=input.device)
            else:
                received = workspace.reshape(-1)[:(world - 1) * k]
            work = _SumAfter(_messages(group, lambda dst: input[dst * k:(dst + 1) * k],
                                       lambda j, src: received[(j - 1) * k:j * k], _REDUCE_SCATTER_TAG),
                             received.view(world - 1, k), output)
        else:
            work = _reduce_scatter_single(output, input, op=op, group=group, async_op=True)
    return _handle("reduce_scatter", work, input, logger, started, group)


def reduce_scatter_workspace_numel(k: int, *, group: dist.ProcessGroup | None) -> int:
    """Elements of the `workspace` a SUM `start_reduce_scatter` with `input_is_scratch` and an output of
    `k` elements (this rank's own slice of the input) receives into: (N-1)k where it runs as
    point-to-point messages (gloo), 0 where the backend's own reduce-scatter runs (nothing to pass)."""
    return (dist.get_world_size(group) - 1) * k if _point_to_point(group) else 0


class _SumAfter:
    """The messages of a reduce-scatter: `wait()` finishes them, then adds the received [N-1, k]
    pieces into `output` [k] (which holds this rank's own piece) one after another in message order,
    so the result does not depend on timing (rounded after each add, as a ring all-reduce is), and
    frees them."""

    def __init__(self, work: Works, received: torch.Tensor, output: torch.Tensor):
        self.work, self.received, self.output = work, received, output

    def wait(self) -> bool:
        if self.received is not None:
            self.work.wait()
            for piece in self.received:  # pairwise adds: torch.sum(dim=0) is 10x slower in bf16
                self.output.add_(piece)
            self.received = self.work = self.output = None  # the works hold the buffers until dropped
        return True

    def is_completed(self) -> bool:
        return self.received is None or self.work.is_completed()


def _is_own_slice(output: torch.Tensor, input: torch.Tensor, group) -> bool:
    k = output.numel()
    rank = dist.get_rank(group)
    return (input.is_contiguous() and output.is_contiguous() and input.numel() == k * dist.get_world_size(group)
            and output.data_ptr() == input.data_ptr() + rank * k * input.element_size())


def start_all_gather(output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None,
                     logger: CommsLogger | None = None) -> CommHandle:
    """Start an all-gather: every rank's `input` ([k]) lands in `output` ([N * k]) at [r*k, (r+1)*k).
    `input` may be this rank's slice of `output` (in place). Counted as `output.numel()` elements
    (the gathered size, as NCCL and DeepSpeed report it), so reduce-scatter + all-gather of Ψ
    elements count 2Ψ. Finish with `.wait()`. On gloo (`_point_to_point`) this rank's slice is sent to
    every other rank and theirs are received in place (`input` is first copied into its slice of
    `output`; `input` may be reused once this returns)."""
    started = time.perf_counter()
    with record_function("zerospeed::all_gather"):
        if _point_to_point(group) and output.is_contiguous():
            k, rank = input.numel(), dist.get_rank(group)
            own = output[rank * k:(rank + 1) * k]
            if own.data_ptr() != input.data_ptr():
                own.copy_(input.reshape(-1))
            work = _messages(group, lambda dst: own, lambda j, src: output[src * k:(src + 1) * k], _ALL_GATHER_TAG)
        else:
            work = _all_gather_single(output, input, group=group, async_op=True)
    return _handle("all_gather", work, output, logger, started, group)
