"""ZeRO stage 0: data parallelism with bucketed gradient all-reduce overlapped with backward.

Each parameter's `.grad` is a view into a flat bucket buffer (PyTorch DDP's
`gradient_as_bucket_view`), so autograd accumulates straight into the bucket and no copy is made.
A `post_accumulate_grad` hook marks a parameter ready; once every parameter of a bucket is ready
the bucket's all-reduce starts, while backward keeps computing. Buckets start strictly in plan
order, so every rank issues the same collectives in the same order. `finish()` flushes buckets
whose parameters got no gradient, waits for all of them and averages.

`OrderedBucketHooks` (hooks + in-order launch) and `GradViews` (`.grad` as views) are shared with
the ZeRO stage 1-2 reduce-scatter (`stage12_grads.py`).
"""
from __future__ import annotations

import enum
import functools

import torch

from ..comm.collectives import GroupCollectives
from ..comm.inflight import ReduceQueue
from .partition import BucketPlan, plan_buckets
from .reduce import gradient_divide_factors


class ReducePhase(enum.Enum):
    IDLE = "idle"            # gradients accumulate locally, nothing is communicated
    ARMED = "armed"          # this backward reduces: hooks start buckets as they fill
    FINISHED = "finished"    # all buckets reduced and averaged


class OrderedBucketHooks:
    """Post-accumulate-grad hooks that start bucket collectives strictly in launch order.

    Shared by every stage that reduces gradients during backward (stage 0 all-reduce, stages 1-2
    reduce-scatter). buckets_of[i]: the launch slots (0 starts first) parameter i has elements in;
    a parameter may feed several buckets when a flat chunk boundary cuts through it. A bucket
    starts once all its parameters are ready and every earlier bucket has started, so all ranks
    issue the same collectives in the same order. Subclasses implement `_store_grad(index, p)`
    (called for every gradient, in any phase) and `_launch(slot)`.
    names: parameter names for error messages (default "#index").
    """

    def __init__(self, params: list[torch.nn.Parameter], buckets_of: list[list[int]], num_buckets: int,
                 names: list[str] | None = None):
        self._buckets_of = [sorted(set(b)) for b in buckets_of]
        self._names = names or [f"#{i}" for i in range(len(params))]
        self._pending = [0] * num_buckets
        for bs in self._buckets_of:
            for b in bs:
                self._pending[b] += 1
        self._ready = [0] * num_buckets
        self._seen = [False] * len(params)
        self._next = 0
        self.phase = ReducePhase.IDLE
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    def _store_grad(self, index: int, p: torch.Tensor) -> None:
        raise NotImplementedError

    def _launch(self, slot: int) -> None:
        raise NotImplementedError

    def arm(self) -> None:
        """Reduce during the coming backward. Raises RuntimeError if already armed."""
        if self.phase is ReducePhase.ARMED:
            raise RuntimeError(f"{type(self).__name__}.arm() called twice without finish()")
        self._ready = [0] * len(self._pending)
        self._seen = [False] * len(self._seen)
        self._next = 0
        self.phase = ReducePhase.ARMED

    def _make_hook(self, index: int):
        def hook(p: torch.Tensor) -> None:
            self._store_grad(index, p)
            if self.phase is ReducePhase.ARMED:
                self._mark_ready(index)
        return hook

    def _mark_ready(self, index: int) -> None:
        if self._seen[index]:
            raise RuntimeError(f"parameter {self._names[index]} received its gradient twice in one reducing "
                               "backward (a second backward through the same graph, or reentrant activation "
                               "checkpointing); its bucket may already be reduced. Use one backward per "
                               "micro-batch and torch.utils.checkpoint(..., use_reentrant=False)")
        self._seen[index] = True
        for b in self._buckets_of[index]:
            self._ready[b] += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self._pending) and (force or self._ready[self._next] >= self._pending[self._next]):
            self._launch(self._next)
            self._next += 1

    def launch_remaining(self) -> None:
        """Start every bucket not started yet (parameters that got no gradient), in order."""
        self._launch_ready(force=True)

    def disarm(self) -> None:
        self.phase = ReducePhase.IDLE

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class GradViews:
    """Keeps each parameter's `.grad` a view into flat gradient storage (DDP's `gradient_as_bucket_view`),
    so autograd accumulates in place. views[i] has parameter i's shape.

    When the storage has another dtype than the parameters (mixed precision: bf16/fp16 parameters,
    fp32 gradient buckets) `.grad` cannot be a view; instead every gradient autograd produces is
    added into its fp32 view and `.grad` is freed (`accumulate` mode), so micro-steps accumulate in
    fp32 and a low-precision gradient lives only from its AccumulateGrad to its hook."""

    def __init__(self, params: list[torch.nn.Parameter], views: list[torch.Tensor], *, accumulate: bool = False):
        self.params = params
        self.views = views
        self.accumulate = accumulate or any(p.dtype != v.dtype for p, v in zip(params, views))

    def store(self, index: int, p: torch.Tensor) -> None:
        """In a post-accumulate-grad hook: move a fresh `.grad` (grads were None) into its view
        (accumulate mode: add it and free `.grad`)."""
        view = self.views[index]
        if self.accumulate:
            view.add_(p.grad)
            p.grad = None
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def attach(self) -> None:
        """Point every `.grad` at its view, copying a gradient the user assigned (accumulate mode:
        add a pending `.grad` into its view and free it)."""
        for p, v in zip(self.params, self.views):
            if self.accumulate:
                if p.grad is not None:
                    v.add_(p.grad)
                    p.grad = None
            elif p.grad is None or p.grad.data_ptr() != v.data_ptr():
                if p.grad is not None:
                    v.copy_(p.grad)
                p.grad = v


class GradientAllReducer(OrderedBucketHooks):
    """Owns the gradient buckets of `params` and their all-reduce (`comms.start_all_reduce`, over its group).

    params: the trainable parameters (deduplicated). comms: the collectives over the data-parallel
    group (`comm.collectives.GroupCollectives`). bucket_size: elements per bucket
    (`reduce_bucket_size`). average: divide by the group size after the sum (`gradient_allreduce_op:
    mean`). predivide_factor: divide by this before the sum and by world/factor after
    (`gradient_predivide_factor`, DeepSpeed semantics) to limit overflow in low precision.
    grad_dtype: dtype the buckets hold and gradients accumulate in (default: the parameters'; fp32
    under mixed precision, see `GradViews`). reduce_dtype: dtype of the all-reduce (default
    grad_dtype); if it differs, each bucket is cast to a temporary for the collective and back.
    `grad_views[i]`: parameter i's gradient, a view into its bucket.

    Lazy mode (`lazy`: mixed precision with the collective in the parameters' 2-byte dtype): the
    buckets start in that dtype (2Ψ bytes, the paper's gradients), gradients are added in and freed
    as in fp32 mode, and the all-reduce runs in place; `materialize()` then makes fp32 buckets (sum /
    post, the roundings of the fp32 path) for the step, and `zero_grad` returns to 2-byte buckets. A
    second micro-step turns the buckets into fp32 before its first gradient is added, so gradient
    accumulation still adds in fp32.

    fp32 (gradients in the parameters' dtype): the buckets hold memory only from a backward to the
    next `zero_grad`, which frees their storage and sets every `.grad` to None (torch's
    `set_to_none`); a bucket's storage comes back, zeroed, when its first gradient arrives. So the
    forward's activation peak holds no gradient memory (4Ψ bytes less, as DeepSpeed's stage 0 and
    torch's own gradients), and backward allocates one bucket at a time while it frees activations.
    """

    def __init__(self, params: list[torch.nn.Parameter], *, comms: GroupCollectives,
                 bucket_size: int, average: bool = True, predivide_factor: float = 1.0,
                 grad_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 average_over: int | None = None):
        self.params = params
        self.comms = comms
        self.world = comms.world_size
        # the mean is over average_over ranks (default the group's): expert parameters are summed over the
        # expert-data group but averaged over the whole data-parallel group (`GroupedReducer`)
        self.predivide, self.post = gradient_divide_factors(average_over or self.world, average=average,
                                                            predivide_factor=predivide_factor)
        if len({p.dtype for p in params}) > 1:
            raise TypeError(f"all trainable parameters must share one dtype for bucketing; "
                            f"got {sorted(str(d) for d in {p.dtype for p in params})}")
        self.grad_dtype = grad_dtype or (params[0].dtype if params else torch.float32)
        self.reduce_dtype = reduce_dtype or self.grad_dtype
        param_dtype = params[0].dtype if params else self.grad_dtype
        self.lazy = self.grad_dtype != param_dtype and self.reduce_dtype == param_dtype
        self.plan: BucketPlan = plan_buckets([p.numel() for p in params], bucket_size)
        self._device = params[0].device if params else None
        self._set_buffers([torch.zeros(n, dtype=param_dtype if self.lazy else self.grad_dtype, device=self._device)
                           for n in self.plan.sizes])
        self._stored = [False] * len(params)  # lazy: got a gradient since the last zero_grad
        self.free_between_steps = self.grad_dtype == param_dtype  # fp32: see the class docstring
        self._bucket_of = [0] * len(params)  # plan_buckets gives every parameter exactly one slot
        for s in self.plan.slots:
            self._bucket_of[s.index] = s.bucket
        self._queue = ReduceQueue(None)  # every bucket stays in flight until finish() (DDP's buckets are the grads)
        super().__init__(params, [[b] for b in self._bucket_of], len(self.plan.sizes))
        if self.free_between_steps:
            self._release_buckets(keep_user_grads=True)
        else:
            self.attach_grads()

    # -- gradient storage -------------------------------------------------------------------
    def _set_buffers(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for s in self.plan.slots:
            views[s.index] = buffers[s.bucket][s.offset:s.offset + s.numel].view_as(self.params[s.index])
        self.grad_views = views
        self._grads = GradViews(self.params, views, accumulate=self.lazy)

    @property
    def grads_ready(self) -> bool:
        """True when `grad_views` hold the gradients the step reads (always, except lazy 2-byte sums)."""
        return not self.buffers or self.buffers[0].dtype == self.grad_dtype

    def materialize(self) -> None:
        """Lazy mode: the 2-byte all-reduced sums become fp32 buckets divided by post (new `grad_views`)."""
        if not self.grads_ready:
            self._set_buffers([b.to(self.grad_dtype).div_(self.post) if self.post != 1.0 else b.to(self.grad_dtype)
                               for b in self.buffers])

    def _ensure_bucket(self, b: int) -> None:
        """Give bucket b its storage back, zeroed (fp32 mode, after `zero_grad` freed it)."""
        buf = self.buffers[b]
        nbytes = buf.numel() * buf.element_size()
        if buf.untyped_storage().nbytes() < nbytes:
            buf.untyped_storage().resize_(nbytes)
            buf.zero_()

    def _release_buckets(self, *, keep_user_grads: bool = False) -> None:
        for p, v in zip(self.params, self.grad_views):
            if not keep_user_grads or (p.grad is not None and p.grad.data_ptr() == v.data_ptr()):
                p.grad = None
        for buf in self.buffers:
            buf.untyped_storage().resize_(0)

    def bucket_bytes(self) -> int:
        """Bytes the gradient buckets hold now (0 between `zero_grad` and the next backward in fp32)."""
        return sum(b.untyped_storage().nbytes() for b in self.buffers)

    def attach_grads(self) -> None:
        """Point every `.grad` at its bucket view (after a user set grads to None, say); fp32 mode
        allocates (zeroed) the buckets that have no storage."""
        for b in range(len(self.buffers)):
            self._ensure_bucket(b)
        self._grads.attach()

    def zero_grad(self) -> None:
        """Zero all gradients: fp32 mode frees the buckets and sets `.grad` to None; otherwise the
        buckets are zeroed in place and `.grad` keeps pointing at them (lazy mode: back to 2-byte
        buckets)."""
        if self.free_between_steps:
            self._release_buckets()
            return
        if self.lazy and self.grads_ready and self.buffers:  # fp32 buckets of the last step: freed
            self._set_buffers([torch.zeros(n, dtype=self.params[0].dtype, device=self._device)
                               for n in self.plan.sizes])
        else:
            for b in self.buffers:
                b.zero_()
        self._stored = [False] * len(self.params)
        self.attach_grads()

    # -- reduction ------------------------------------------------------------------------
    def arm(self) -> None:
        """Reduce during the coming backward (call at the gradient accumulation boundary)."""
        super().arm()
        self._queue = ReduceQueue(None)

    def _store_grad(self, index: int, p: torch.Tensor) -> None:
        self._ensure_bucket(self._bucket_of[index])
        if self.lazy:
            if self._stored[index] and not self.grads_ready:  # a second micro-step: accumulate in fp32
                self._set_buffers([b.to(self.grad_dtype) for b in self.buffers])
            self._stored[index] = True
        self._grads.store(index, p)

    def _launch(self, slot: int) -> None:
        buf = self.buffers[slot]
        send = buf if buf.dtype == self.reduce_dtype else buf.to(self.reduce_dtype)
        if self.predivide != 1.0:
            send.div_(self.predivide)
        self._queue.push(self.comms.start_all_reduce(send),
                         functools.partial(self._bucket_done, send, slot))

    def _bucket_done(self, send: torch.Tensor, slot: int) -> None:
        """Bucket `slot`'s all-reduce (of `send`: the bucket, or a cast temporary) is done: copy it back
        and average (lazy 2-byte sums are divided by `materialize()`). Runs in `finish()`; the bucket is
        looked up only then (a lazy second micro-step may have replaced the buffers by fp32 ones)."""
        buf = self.buffers[slot]
        if send is not buf:
            buf.copy_(send)
        if self.post != 1.0 and buf.dtype == self.grad_dtype:
            buf.div_(self.post)

    def finish(self) -> None:
        """Start any bucket not yet started (unused parameters), wait for all, average."""
        if self.phase is not ReducePhase.ARMED:
            raise RuntimeError("GradientAllReducer.finish() without arm()")
        self.attach_grads()
        self.launch_remaining()
        self._queue.wait_all()
        self.phase = ReducePhase.FINISHED

    def remove(self) -> None:
        """Remove the hooks and release the buckets (`engine.destroy()`)."""
        self.remove_hooks()
        for p in self.params:
            p.grad = None
        self.buffers = []
        self._grads = GradViews([], [])


class GroupedReducer:
    """Several `GradientAllReducer`s as one: each reduces its own parameters over its own process group (a
    mixture-of-experts model: the dense parameters over the data-parallel group, the experts over the
    expert-data group, both averaged over the data-parallel ranks). Same interface as one reducer
    (`phase`, `arm`, `finish`, `disarm`, `materialize`, `grads_ready`, `grad_views` in `params` order,
    `zero_grad`, `attach_grads`, `remove`, `bucket_bytes`); the parts move through their phases together.
    parts: (indices into `params`, the reducer built over exactly those parameters, in that order)."""

    def __init__(self, params: list[torch.nn.Parameter], parts: list[tuple[list[int], GradientAllReducer]]):
        covered = sorted(i for idx, _ in parts for i in idx)
        if covered != list(range(len(params))):
            raise ValueError("GroupedReducer: the parts must cover every parameter exactly once")
        self.params, self.parts = params, parts

    @property
    def phase(self) -> ReducePhase:
        return self.parts[0][1].phase

    @property
    def grads_ready(self) -> bool:
        return all(r.grads_ready for _, r in self.parts)

    @property
    def grad_views(self) -> list[torch.Tensor]:
        views: list = [None] * len(self.params)
        for idx, r in self.parts:
            for i, v in zip(idx, r.grad_views):
                views[i] = v
        return views

    def arm(self) -> None:
        for _, r in self.parts:
            r.arm()

    def finish(self) -> None:
        for _, r in self.parts:
            r.finish()

    def disarm(self) -> None:
        for _, r in self.parts:
            r.disarm()

    def materialize(self) -> None:
        for _, r in self.parts:
            r.materialize()

    def zero_grad(self) -> None:
        for _, r in self.parts:
            r.zero_grad()

    def attach_grads(self) -> None:
        for _, r in self.parts:
            r.attach_grads()

    def remove(self) -> None:
        for _, r in self.parts:
            r.remove()

    def bucket_bytes(self) -> int:
        return sum(r.bucket_bytes() for _, r in self.parts)
