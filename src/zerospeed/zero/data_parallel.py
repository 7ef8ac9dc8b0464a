"""ZeRO stage 0: data parallelism with bucketed gradient all-reduce overlapped with backward.

Each parameter's `.grad` is a view into a flat bucket buffer (PyTorch DDP's
`gradient_as_bucket_view`), so autograd accumulates straight into the bucket and no copy is made.
A `post_accumulate_grad` hook marks a parameter ready; once every parameter of a bucket is ready
the bucket's all-reduce starts, while backward keeps computing. Buckets start strictly in plan
order, so every rank issues the same collectives in the same order. `finish()` flushes buckets
whose parameters got no gradient, waits for all of them and averages.
"""
from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from ..comm.logger import CommsLogger
from ..comm.ops import CommHandle, start_all_reduce
from .buckets import BucketPlan, plan_buckets


class ReducePhase(enum.Enum):
    IDLE = "idle"            # gradients accumulate locally, nothing is communicated
    ARMED = "armed"          # this backward reduces: hooks start buckets as they fill
    FINISHED = "finished"    # all buckets reduced and averaged


class GradientAllReducer:
    """Owns the gradient buckets of `params` and their all-reduce over `group`.

    params: the trainable parameters (deduplicated). bucket_size: elements per bucket
    (`reduce_bucket_size`). average: divide by the group size after the sum (`gradient_allreduce_op:
    mean`). predivide_factor: divide by this before the sum and by world/factor after
    (`gradient_predivide_factor`, DeepSpeed semantics) to limit overflow in low precision.
    reduce_dtype: dtype the buckets hold (the gradient dtype).
    """

    def __init__(self, params: list[torch.nn.Parameter], *, group: dist.ProcessGroup | None,
                 bucket_size: int, average: bool = True, predivide_factor: float = 1.0,
                 logger: CommsLogger | None = None):
        self.params = params
        self.group = group
        self.world = dist.get_world_size(group)
        self.average = average
        self.predivide = predivide_factor
        self.logger = logger
        self.plan: BucketPlan = plan_buckets([p.numel() for p in params], bucket_size)
        self.buffers = [torch.zeros(n, dtype=params[0].dtype if params else torch.float32,
                                    device=params[0].device if params else None) for n in self.plan.sizes]
        self._bucket_of = {}
        self._views: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        for s in self.plan.slots:
            p = params[s.index]
            if p.dtype != self.buffers[s.bucket].dtype:
                raise TypeError(f"all trainable parameters must share one dtype for bucketing; "
                                f"got {p.dtype} and {self.buffers[s.bucket].dtype}")
            self._views[s.index] = self.buffers[s.bucket][s.offset:s.offset + s.numel].view_as(p)
            self._bucket_of[s.index] = s.bucket
        self._pending = [len(self.plan.members(b)) for b in range(len(self.plan.sizes))]
        self._ready = [0] * len(self.plan.sizes)
        self._next = 0
        self._handles: list[CommHandle] = []
        self.phase = ReducePhase.IDLE
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]
        self.attach_grads()

    # -- gradient storage -------------------------------------------------------------------
    def attach_grads(self) -> None:
        """Point every `.grad` at its bucket view (after a user set grads to None, say)."""
        for p, v in zip(self.params, self._views):
            if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                if p.grad is not None:
                    v.copy_(p.grad)
                p.grad = v

    def zero_grad(self) -> None:
        """Zero all gradients in place (the buckets); `.grad` keeps pointing at them."""
        for b in self.buffers:
            b.zero_()
        self.attach_grads()

    # -- reduction ------------------------------------------------------------------------
    def arm(self) -> None:
        """Reduce during the coming backward (call at the gradient accumulation boundary)."""
        if self.phase is ReducePhase.ARMED:
            raise RuntimeError("GradientAllReducer.arm() called twice without finish()")
        self._ready = [0] * len(self.plan.sizes)
        self._next = 0
        self._handles = []
        self.phase = ReducePhase.ARMED

    def _make_hook(self, index: int):
        def hook(p: torch.Tensor) -> None:
            view = self._views[index]
            if p.grad.data_ptr() != view.data_ptr():  # autograd made a fresh tensor (grads were None)
                view.copy_(p.grad)
                p.grad = view
            if self.phase is not ReducePhase.ARMED:
                return
            b = self._bucket_of[index]
            self._ready[b] += 1
            self._launch_ready()
        return hook

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buffers) and (force or self._ready[self._next] >= self._pending[self._next]):
            buf = self.buffers[self._next]
            if self.predivide != 1.0:
                buf.div_(self.predivide)
            self._handles.append(start_all_reduce(buf, group=self.group, logger=self.logger))
            self._next += 1

    def finish(self) -> None:
        """Start any bucket not yet started (unused parameters), wait for all, average."""
        if self.phase is not ReducePhase.ARMED:
            raise RuntimeError("GradientAllReducer.finish() without arm()")
        self.attach_grads()
        self._launch_ready(force=True)
        post = (self.world / self.predivide) if self.average else (1.0 / self.predivide)
        for h, buf in zip(self._handles, self.buffers):
            h.wait()
            if post != 1.0:
                buf.div_(post)
        self.phase = ReducePhase.FINISHED

    def disarm(self) -> None:
        self.phase = ReducePhase.IDLE

    def remove(self) -> None:
        """Remove the hooks and release the buckets (`engine.destroy()`)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.params:
            p.grad = None
        self.buffers = []
        self._views = []
