"""Gradient storage and reduce-scatter for ZeRO stages 1 and 2 (used by `stage12.py`).

A `FlatPartition` cuts the flat gradient into K chunks of L elements; each chunk is reduce-scattered
in reverse order as backward fills it (`OrderedBucketHooks`), rank r receiving its shard (S = L / N
elements), averaged over N. `partition_grad` ([K, S]) is this rank's averaged gradient, the
optimizer's `.grad`.

Three dtypes (from the `MixedPrecisionPolicy`): `dtype`, the parameters' (stage 1's full gradient
buffer, whose views are the parameters' `.grad`); `reduce_dtype`, the collectives'; `grad_dtype`,
`partition_grad`'s (fp32 under bf16/fp16, else the parameters'). A chunk whose storage is not in
`reduce_dtype` is cast to a temporary for its collective.

- Stage 1 keeps the full gradient in `dtype` (Ψ elements): autograd accumulates micro-steps into it
  (in bf16/fp16 under mixed precision, as DeepSpeed's stage 1 does; fp32 accumulation would need a
  4Ψ buffer), and it is reduce-scattered at the boundary. In fp32 `partition_grad` is a strided view
  of it (no copy); under mixed precision it is a separate fp32 [K, S] tensor that exists only from
  the reduction to `zero_grad()` (DeepSpeed also creates the fp32 partition gradient per step).
- Stage 2 keeps only `partition_grad` (Ψ/N elements, fp32 under mixed precision, persistent: every
  micro-step's reduced shard is added into it, so accumulation is in fp32). A gradient is copied
  into a zeroed scratch buffer of its chunk (L elements, in `reduce_dtype`) and `.grad` is freed;
  the scratch is reduce-scattered in place and its shard added into `partition_grad`. At most
  `MAX_CHUNKS_IN_FLIGHT` chunks are in flight, so scratch peaks at about four chunks; it is reused
  within a backward and freed when it ends. Every micro-step reduces, as DeepSpeed's stage 2 does.
  Scratch is allocated empty: every element is either copied from a gradient or, when the chunk
  is launched, zeroed (parameters that got no gradient, padding), so nothing is written twice.

Every reduce-scatter input here is ours to overwrite (stage 2's scratch, stage 1's flat gradient or
its cast temporary), so `_ChunkReducer` passes `input_is_scratch=True` to
`GroupCollectives.start_reduce_scatter` (`comm.ops.start_reduce_scatter`; on gloo: point-to-point
messages and a local sum instead of gloo's clone + all-reduce; the messages for this rank land in a
temporary of (N-1)/N of the chunk's size, so each chunk in flight holds its L-element buffer and that
temporary until its `wait()`). Both
stages finish a chunk's reduction as soon as it is done and never keep more than
`MAX_CHUNKS_IN_FLIGHT` (+ the one just started) in flight, so those temporaries are reused within a
backward rather than one allocated per chunk. Only this rank's shard of a chunk holds the reduced
gradient afterwards; stage 1's `.grad` views elsewhere hold this rank's own unreduced values, as in
DeepSpeed. The bound and the in-order finishing are `comm.inflight.ReduceQueue`'s, shared with stages
0 and 3.
"""
from __future__ import annotations

import functools

import torch

from ..comm.collectives import GroupCollectives
from ..comm.inflight import ReduceQueue
from ..offload.hostmem import host_empty
from .data_parallel import GradViews, OrderedBucketHooks, ReducePhase
from .partition import FlatPartition
from .reduce import gradient_divide_factors

MAX_CHUNKS_IN_FLIGHT = 2  # chunks reduced concurrently (each holds a receive buffer; stage 2 also its scratch)


class _ChunkReducer(OrderedBucketHooks):
    """Reduce-scatters the gradient chunks of a `FlatPartition` (`comms.start_reduce_scatter`, over the
    data-parallel group; this rank is `comms.rank`) as backward produces them.

    Subclasses say where a chunk's gradient lives (`_chunk_grad`) and what to do once its reduce-
    scatter is done (`_complete`). `partition_grad` is this rank's averaged gradient, [K, S].
    """

    def __init__(self, params, layout: FlatPartition, names, *, comms: GroupCollectives, average: bool,
                 predivide: float, dtype: torch.dtype, device: torch.device,
                 grad_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 average_over: int | None = None):
        self.params, self.layout, self.comms, self.rank = params, layout, comms, comms.rank
        # the mean is over average_over ranks (default the group's): an expert partition is summed over the
        # expert-data group but averaged over every data-parallel rank
        self.predivide, self.post = gradient_divide_factors(average_over or layout.world_size, average=average,
                                                            predivide_factor=predivide)
        self.dtype, self.device = dtype, device
        self.grad_dtype = grad_dtype or dtype
        self.reduce_dtype = reduce_dtype or dtype
        # finish reductions that are done, and block once too many are in flight: each holds a receive
        # buffer (and stage 2 its scratch) until its wait, so a backward reuses a few chunks' worth of
        # memory instead of allocating one per chunk (fresh pages every step: 13 x 13 MB on the 85M
        # GPT in fp32 for stage 1, all alive at the end of backward)
        self._queue = ReduceQueue(MAX_CHUNKS_IN_FLIGHT, finish_early=True)
        k = layout.num_chunks
        super().__init__(params, [[k - 1 - c for c in layout.chunks_of(i)] for i in range(len(params))], k, names)

    @property
    def peak_inflight(self) -> int:
        """Most chunks in flight at once so far (at most MAX_CHUNKS_IN_FLIGHT + 1)."""
        return self._queue.peak

    def _own(self, chunk_grad: torch.Tensor) -> torch.Tensor:
        s = self.layout.shard_numel
        return chunk_grad[self.rank * s:(self.rank + 1) * s]

    def _launch(self, slot: int) -> None:
        chunk = self.layout.num_chunks - 1 - slot
        buf = self._chunk_grad(chunk)
        send = buf if buf.dtype == self.reduce_dtype else buf.to(self.reduce_dtype)
        if self.predivide != 1.0:
            send.div_(self.predivide)
        out = self._own(send)
        extra = self.comms.reduce_scatter_workspace_numel(out.numel())  # recycled: no fresh pages per chunk
        workspace = host_empty(extra, send.dtype, send.device) if extra else None
        handle = self.comms.start_reduce_scatter(out, send, input_is_scratch=True, workspace=workspace)
        self._queue.push(handle, functools.partial(self._complete, chunk, out))

    def finish(self) -> None:
        """Start the chunks not started yet (parameters without a gradient), wait for all, average.
        Raises RuntimeError without a preceding arm()."""
        if self.phase is not ReducePhase.ARMED:
            raise RuntimeError(f"{type(self).__name__}.finish() without arm()")
        self._flush_grads()
        self.launch_remaining()
        self._queue.wait_all()
        self._after_finish()
        self.phase = ReducePhase.FINISHED

    def _after_finish(self) -> None:
        pass

    def materialize(self) -> None:
        """Make `partition_grad` the fp32 gradient the step reads (Stage2Grads may hold 2-byte sums)."""

    def _copy_into_chunk(self, index: int, grad: torch.Tensor, chunk: int, dst: torch.Tensor) -> None:
        """Copy the part of parameter `index`'s gradient that lies in `chunk` into `dst` ([L])."""
        p_start, p_end = self.layout.param_range(index)
        c_start, c_end = self.layout.chunk_range(chunk)
        lo, hi = max(p_start, c_start), min(p_end, c_end)
        dst[lo - c_start:hi - c_start].copy_(grad.reshape(-1)[lo - p_start:hi - p_start])


class Stage1Grads(_ChunkReducer):
    """Stage 1: full flat gradient buffer ([padded Ψ], `dtype`); `.grad` are views; reduce-scatter at
    the boundary (in place when `dtype == reduce_dtype`)."""

    def __init__(self, params, layout, names, **kw):
        super().__init__(params, layout, names, **kw)
        self.flat = torch.zeros(layout.padded_numel, dtype=self.dtype, device=self.device)
        self._views = GradViews(params, [self.flat[a:b].view_as(p) for p, (a, b) in
                                         zip(params, map(layout.param_range, range(len(params))))])
        self._views.attach()
        s, r = layout.shard_numel, self.rank
        self._own_view = self.flat.view(layout.num_chunks, layout.chunk_numel)[:, r * s:(r + 1) * s]
        self.separate = self.grad_dtype != self.dtype  # fp32 partition gradient of its own (mixed precision)
        self.partition_grad = None if self.separate else self._own_view
        # mixed precision, reduced in place: the 2-byte sums stay in `flat` until `materialize()`
        self.lazy = self.separate and self.dtype == self.reduce_dtype
        self._reduced = False

    def _store_grad(self, index, p):
        self._views.store(index, p)

    def _chunk_grad(self, chunk):
        return self.flat[slice(*self.layout.chunk_range(chunk))]

    def _flush_grads(self):
        self._views.attach()

    def _complete(self, chunk, own):
        if self.lazy:  # `own` is this chunk's row of _own_view: converted by materialize()
            self._reduced = True
            return
        if self.partition_grad is None:
            self.partition_grad = torch.empty(self.layout.num_chunks, self.layout.shard_numel, dtype=self.grad_dtype,
                                              device=self.device)
        dst = self.partition_grad[chunk]
        if dst.data_ptr() != own.data_ptr():
            dst.copy_(own)
        if self.post != 1.0:
            dst.div_(self.post)

    def materialize(self) -> None:
        """Mixed precision: this rank's reduced 2-byte sums (its shard of each chunk of `flat`) become
        the fp32 partition gradient, divided by post (the roundings of the eager path)."""
        if self.lazy and self._reduced:
            g = self._own_view.to(self.grad_dtype)
            self.partition_grad = g.div_(self.post) if self.post != 1.0 else g
            self._reduced = False

    def zero_grad(self):
        self.flat.zero_()
        self._views.attach()
        if self.separate:
            self.partition_grad = None
        self._reduced = False

    def grad_bytes(self) -> int:
        extra = self.partition_grad.numel() * self.partition_grad.element_size() \
            if self.separate and self.partition_grad is not None else 0
        return self.flat.numel() * self.flat.element_size() + extra


class Stage2Grads(_ChunkReducer):
    """Stage 2: the partition gradient ([K, S], `grad_dtype`) plus per-chunk scratch ([L],
    `reduce_dtype`) while reducing. fp32: persistent, zeroed by `zero_grad`. Mixed precision: the
    first backward of a step keeps the 2-byte reduced sums as they are (`lp_grad`, [K, S]: the paper's
    2Ψ/N gradient partition), turned into the fp32 `partition_grad` (times 1/post) by `materialize()`
    when the step reads it, or first thing in a second backward (gradient accumulation then adds in
    fp32, as before); `zero_grad` frees both."""

    def __init__(self, params, layout, names, **kw):
        super().__init__(params, layout, names, **kw)
        self.lazy = self.grad_dtype != self.reduce_dtype
        self.partition_grad = None if self.lazy else \
            torch.zeros(layout.num_chunks, layout.shard_numel, dtype=self.grad_dtype, device=self.device)
        self.lp_grad: torch.Tensor | None = None
        self._lp_complete = False  # lp_grad holds a whole backward's sums (a next backward materializes)
        self._scratch: dict[int, torch.Tensor] = {}
        self._free: list[torch.Tensor] = []
        # per chunk: (parameter index, [lo, hi) within the chunk) of every parameter with elements in it
        self._spans = [[] for _ in range(layout.num_chunks)]
        for i in range(len(params)):
            p_start, p_end = layout.param_range(i)
            for c in layout.chunks_of(i):
                c_start, c_end = layout.chunk_range(c)
                self._spans[c].append((i, max(p_start, c_start) - c_start, min(p_end, c_end) - c_start))
        self.peak_scratch_bytes = 0  # largest scratch held at once (bytes), for benchmarks and tests

    def _chunk_grad(self, chunk):
        buf = self._scratch.get(chunk)
        if buf is None:
            buf = self._free.pop() if self._free else \
                torch.empty(self.layout.chunk_numel, dtype=self.reduce_dtype, device=self.device)
            self._scratch[chunk] = buf
            self.peak_scratch_bytes = max(self.peak_scratch_bytes, self.scratch_bytes())
        return buf

    def _store_grad(self, index, p):
        if self.phase is not ReducePhase.ARMED:
            return  # not reducing: autograd keeps accumulating into p.grad, consumed by the next reduce
        for chunk in self.layout.chunks_of(index):
            self._copy_into_chunk(index, p.grad, chunk, self._chunk_grad(chunk))
        p.grad = None

    def _launch(self, slot):
        # the scratch is uninitialised: zero what no gradient was copied into (no gradient; padding)
        chunk = self.layout.num_chunks - 1 - slot
        buf = self._chunk_grad(chunk)
        for i, lo, hi in self._spans[chunk]:
            if not self._seen[i]:
                buf[lo:hi].zero_()
        c_start, c_end = self.layout.chunk_range(chunk)
        if c_end > self.layout.numel:
            buf[max(self.layout.numel, c_start) - c_start:].zero_()
        super()._launch(slot)

    def _flush_grads(self):
        for i, p in enumerate(self.params):  # gradients from a plain loss.backward() (not armed)
            if p.grad is not None and not self._seen[i]:
                self._store_grad(i, p)
                self._mark_ready(i)

    def _complete(self, chunk, own):
        if self.lazy and self.partition_grad is None and not self._lp_complete:
            if self.lp_grad is None:
                self.lp_grad = torch.empty(self.layout.num_chunks, self.layout.shard_numel, dtype=own.dtype,
                                           device=self.device)
            self.lp_grad[chunk].copy_(own)
            self._free.append(self._scratch.pop(chunk))
            return
        self.materialize()
        if own.dtype == self.partition_grad.dtype:
            if self.post != 1.0:
                own.div_(self.post)
            self.partition_grad[chunk].add_(own)
        else:  # mixed precision: add the bf16/fp16 sum into the fp32 accumulator, divided in fp32
            self.partition_grad[chunk].add_(own, alpha=1.0 / self.post)
        self._free.append(self._scratch.pop(chunk))

    def _after_finish(self):
        self._free = []  # between backwards a rank holds only its partition gradient
        self._lp_complete = self.lp_grad is not None

    def materialize(self) -> None:
        """The kept 2-byte sums (`lp_grad`) become the fp32 `partition_grad`, times 1/post (the same
        rounding as adding them into zeros)."""
        if self.lp_grad is not None:
            self.partition_grad = torch.mul(self.lp_grad.to(self.grad_dtype), 1.0 / self.post)
            self.lp_grad, self._lp_complete = None, False

    def scratch_bytes(self) -> int:
        n = len(self._scratch) + len(self._free)
        return n * self.layout.chunk_numel * torch.empty(0, dtype=self.reduce_dtype).element_size()

    def zero_grad(self):
        if self.lazy:
            self.partition_grad = self.lp_grad = None
            self._lp_complete = False
        else:
            self.partition_grad.zero_()
        for p in self.params:
            p.grad = None

    def grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in (self.partition_grad, self.lp_grad) if g is not None) \
            + self.scratch_bytes()
