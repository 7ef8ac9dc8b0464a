"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, §5.1 P_os and §5.2 P_os+g), fp32.

Layout (`partition.py`): every trainable parameter becomes a view into one flat buffer of Ψ
elements (+ padding), cut into K equal chunks; rank r owns shard r of each chunk, so its
partition is the strided view `flat.view(K, L)[:, r*S:(r+1)*S]` ([K, S] elements, S = L / N).
The optimizer is built over that one tensor ("master"): in fp32 it *is* the rank's slice of the
parameters, so no master copy exists and the update lands in the flat buffer in place. After the
step each chunk is all-gathered in place (one collective per chunk).

Gradients: chunks are reduce-scattered in reverse order as backward fills them
(`OrderedBucketHooks`), each rank receiving its shard, averaged over N.
- Stage 1 keeps the full gradient: `.grad` of every parameter is a view into a flat gradient buffer
  (Ψ elements), accumulated locally across micro-steps and reduce-scattered in place at the
  boundary. Afterwards only this rank's shards hold averaged values; the rest of the buffer still
  holds this rank's local gradients (ZeRO makes no promise about `.grad` outside the partition).
- Stage 2 keeps only the partition gradient ([K, S], Ψ/N elements). A gradient is copied into a
  zeroed scratch buffer of its chunk (L elements) and `.grad` is freed; the scratch is reduce-
  scattered in place and its shard added into the partition gradient. At most two chunks are in
  flight, so scratch peaks at about four chunks (two in flight, the one filling, and the next one
  when a parameter straddles the boundary); it is reused within a backward and freed when it
  ends. Every micro-step reduces (`reduce_every_micro_step`), as DeepSpeed's stage 2 does.
Communication per step and rank: reduce-scatter input Ψ (stage 2: Ψ per micro-step) + all-gather
output Ψ elements, i.e. 2Ψ, as for an all-reduce (§7).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..comm.logger import CommsLogger
from ..comm.ops import CommHandle, all_reduce, start_all_gather, start_reduce_scatter
from .data_parallel import GradViews, OrderedBucketHooks, ReducePhase
from .partition import FlatPartition, plan_flat_partition
from .strategy import ZeroStrategy, _optimizer_state_bytes

MAX_CHUNKS_IN_FLIGHT = 2  # stage 2: chunks reduced concurrently (each holds an L-element scratch buffer)


class _ChunkReducer(OrderedBucketHooks):
    """Reduce-scatters the gradient chunks of a `FlatPartition` over `group` as backward produces them.

    Subclasses say where a chunk's gradient lives (`_chunk_grad`) and what to do once its reduce-
    scatter is done (`_complete`). `partition_grad` is this rank's averaged gradient, [K, S].
    """

    def __init__(self, params, layout: FlatPartition, names, *, group, rank: int, average: bool,
                 predivide: float, logger: CommsLogger | None, dtype: torch.dtype, device: torch.device):
        self.params, self.layout, self.group, self.rank, self.logger = params, layout, group, rank, logger
        self.predivide = predivide
        self.post = (layout.world_size / predivide) if average else (1.0 / predivide)
        self.dtype, self.device = dtype, device
        self._inflight: list[tuple[int, CommHandle]] = []
        k = layout.num_chunks
        super().__init__(params, [[k - 1 - c for c in layout.chunks_of(i)] for i in range(len(params))], k, names)

    def _own(self, chunk_grad: torch.Tensor) -> torch.Tensor:
        s = self.layout.shard_numel
        return chunk_grad[self.rank * s:(self.rank + 1) * s]

    def _launch(self, slot: int) -> None:
        chunk = self.layout.num_chunks - 1 - slot
        buf = self._chunk_grad(chunk)
        if self.predivide != 1.0:
            buf.div_(self.predivide)
        self._inflight.append((chunk, start_reduce_scatter(self._own(buf), buf, group=self.group, logger=self.logger)))

    def _complete_oldest(self) -> None:
        chunk, handle = self._inflight.pop(0)
        handle.wait()
        self._complete(chunk, self._own(self._chunk_grad(chunk)))

    def finish(self) -> None:
        """Start the chunks not started yet (parameters without a gradient), wait for all, average.
        Raises RuntimeError without a preceding arm()."""
        if self.phase is not ReducePhase.ARMED:
            raise RuntimeError(f"{type(self).__name__}.finish() without arm()")
        self._flush_grads()
        self.launch_remaining()
        while self._inflight:
            self._complete_oldest()
        self._after_finish()
        self.phase = ReducePhase.FINISHED

    def _after_finish(self) -> None:
        pass

    def _copy_into_chunk(self, index: int, grad: torch.Tensor, chunk: int, dst: torch.Tensor) -> None:
        """Copy the part of parameter `index`'s gradient that lies in `chunk` into `dst` ([L])."""
        p_start, p_end = self.layout.param_range(index)
        c_start, c_end = self.layout.chunk_range(chunk)
        lo, hi = max(p_start, c_start), min(p_end, c_end)
        dst[lo - c_start:hi - c_start].copy_(grad.reshape(-1)[lo - p_start:hi - p_start])


class Stage1Grads(_ChunkReducer):
    """Stage 1: full flat gradient buffer ([padded Ψ]); `.grad` are views; in-place reduce-scatter."""

    def __init__(self, params, layout, names, **kw):
        super().__init__(params, layout, names, **kw)
        self.flat = torch.zeros(layout.padded_numel, dtype=self.dtype, device=self.device)
        self._views = GradViews(params, [self.flat[a:b].view_as(p) for p, (a, b) in
                                         zip(params, map(layout.param_range, range(len(params))))])
        self._views.attach()
        s, r = layout.shard_numel, self.rank
        self.partition_grad = self.flat.view(layout.num_chunks, layout.chunk_numel)[:, r * s:(r + 1) * s]

    def _store_grad(self, index, p):
        self._views.store(index, p)

    def _chunk_grad(self, chunk):
        return self.flat[slice(*self.layout.chunk_range(chunk))]

    def _flush_grads(self):
        self._views.attach()

    def _complete(self, chunk, own):
        if self.post != 1.0:
            own.div_(self.post)

    def zero_grad(self):
        self.flat.zero_()
        self._views.attach()

    def grad_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class Stage2Grads(_ChunkReducer):
    """Stage 2: persistent partition gradient ([K, S]) plus per-chunk scratch ([L]) while reducing."""

    def __init__(self, params, layout, names, **kw):
        super().__init__(params, layout, names, **kw)
        self.partition_grad = torch.zeros(layout.num_chunks, layout.shard_numel, dtype=self.dtype, device=self.device)
        self._scratch: dict[int, torch.Tensor] = {}
        self._free: list[torch.Tensor] = []
        self.peak_scratch_bytes = 0  # largest scratch held at once (bytes), for benchmarks and tests

    def _chunk_grad(self, chunk):
        buf = self._scratch.get(chunk)
        if buf is None:
            buf = self._free.pop().zero_() if self._free else \
                torch.zeros(self.layout.chunk_numel, dtype=self.dtype, device=self.device)
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
        super()._launch(slot)
        # free scratch early: finish reductions that are done, and block once too many are in flight
        while self._inflight and (len(self._inflight) > MAX_CHUNKS_IN_FLIGHT
                                  or self._inflight[0][1].work.is_completed()):
            self._complete_oldest()

    def _flush_grads(self):
        for i, p in enumerate(self.params):  # gradients from a plain loss.backward() (not armed)
            if p.grad is not None and not self._seen[i]:
                self._store_grad(i, p)
                self._mark_ready(i)

    def _complete(self, chunk, own):
        if self.post != 1.0:
            own.div_(self.post)
        self.partition_grad[chunk].add_(own)
        self._free.append(self._scratch.pop(chunk))

    def _after_finish(self):
        self._free = []  # between backwards a rank holds only its partition gradient

    def scratch_bytes(self) -> int:
        n = len(self._scratch) + len(self._free)
        return n * self.layout.chunk_numel * self.partition_grad.element_size()

    def zero_grad(self):
        self.partition_grad.zero_()
        for p in self.params:
            p.grad = None

    def grad_bytes(self) -> int:
        return self.partition_grad.numel() * self.partition_grad.element_size() + self.scratch_bytes()


def _check_params(module: nn.Module, params: list[nn.Parameter], stage: int) -> list[str]:
    """Parameter names; raises ValueError / TypeError naming what to change."""
    if not params:
        raise ValueError(f"ZeRO stage {stage} found no trainable parameters (requires_grad=True) in the model")
    names = {id(p): n for n, p in module.named_parameters()}
    names = [names.get(id(p), f"#{i}") for i, p in enumerate(params)]
    for attr, what, fix in (("dtype", "dtypes", "cast the model to one dtype (e.g. model.float()) before "
                             "zerospeed.initialize, or freeze the odd ones with requires_grad=False"),
                            ("device", "devices", "move the whole model to one device first")):
        kinds: dict = {}
        for n, p in zip(names, params):
            kinds.setdefault(getattr(p, attr), []).append(n)
        if len(kinds) > 1:
            desc = "; ".join(f"{k}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}" for k, v in kinds.items())
            raise TypeError(f"ZeRO stage {stage} keeps all trainable parameters in one flat buffer, but they "
                            f"mix {what} ({desc}); {fix}")
    if not params[0].dtype.is_floating_point:
        raise TypeError(f"ZeRO stage {stage} needs floating-point parameters, got {params[0].dtype}")
    return names


class Stage12Strategy(ZeroStrategy):
    """ZeRO stage 1 (optimizer states partitioned) or 2 (+ gradients), fp32, over `group`.

    module: the model (already on its device, identical on every rank). params: its trainable
    parameters, deduplicated, in registration order; they become views into one flat buffer.
    make_optimizer: callable(list of tensors) -> torch optimizer; it receives one tensor, this rank's
    partition ([K, S] fp32, strided view of the flat buffer). reduce_bucket_size /
    allgather_bucket_size: elements; the chunk length L is at most the smaller of the two (0 = no
    all-gather limit) plus N - 1. average: divide the summed gradients by N (`gradient_allreduce_op`
    mean). predivide_factor: DeepSpeed's `gradient_predivide_factor`.
    Raises ValueError (no trainable parameters; wrong optimizer), TypeError (mixed dtypes or devices;
    an optimizer that cannot be built over the partition), NotImplementedError (reduce_scatter=false,
    allgather_partitions=false).
    Source: ZeRO, Rajbhandari et al. 2020, §5.1-5.2.
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter], make_optimizer, *, stage: int,
                 group: dist.ProcessGroup | None, reduce_bucket_size: int, allgather_bucket_size: int = 0,
                 reduce_scatter: bool = True, allgather_partitions: bool = True, average: bool = True,
                 predivide_factor: float = 1.0, logger: CommsLogger | None = None):
        if stage not in (1, 2):
            raise ValueError(f"Stage12Strategy implements ZeRO stages 1 and 2, not {stage}")
        for key, value in (("reduce_scatter", reduce_scatter), ("allgather_partitions", allgather_partitions)):
            if not value:
                raise NotImplementedError(f"zero_optimization.{key}=false is not supported with stage {stage}: "
                                          f"zerospeed always uses reduce-scatter + all-gather; remove the key")
        names = _check_params(module, params, stage)
        self.stage, self.params, self.group, self.logger = stage, params, group, logger
        self.reduce_every_micro_step = stage == 2
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        limit = min(reduce_bucket_size, allgather_bucket_size) if allgather_bucket_size > 0 else reduce_bucket_size
        self.layout = layout = plan_flat_partition([p.numel() for p in params], self.world, limit)
        dtype, device = params[0].dtype, params[0].device
        self.flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for i, p in enumerate(params):
                view = self.flat[slice(*layout.param_range(i))]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
        s = layout.shard_numel
        self.master = self.flat.view(layout.num_chunks, layout.chunk_numel)[:, self.rank * s:(self.rank + 1) * s]
        grads_cls = Stage1Grads if stage == 1 else Stage2Grads
        self.grads = grads_cls(params, layout, names, group=group, rank=self.rank, average=average,
                               predivide=predivide_factor, logger=logger, dtype=dtype, device=device)
        self.optimizer = self._build_optimizer(make_optimizer)

    def _build_optimizer(self, make_optimizer):
        if make_optimizer is None:
            return None
        try:
            opt = make_optimizer([self.master])
        except Exception as exc:  # noqa: BLE001 - re-raised with the fix
            raise TypeError(f"ZeRO stage {self.stage} builds the optimizer over one flat fp32 tensor per rank "
                            f"(this rank's partition, shape {tuple(self.master.shape)}), and that failed: "
                            f"{type(exc).__name__}: {exc}. Pass optimizer= as a callable params -> optimizer, or "
                            "describe it in the ds_config 'optimizer' block, instead of an optimizer object "
                            "whose class cannot be rebuilt from (params, **defaults)") from exc
        owned = [p for g in opt.param_groups for p in g["params"]]
        if len(owned) != 1 or owned[0] is not self.master:
            raise ValueError(f"the optimizer for ZeRO stage {self.stage} must optimize exactly the one tensor it "
                             f"is given (this rank's partition), but it holds {len(owned)} other tensor(s); a "
                             "callable optimizer must build over its params argument")
        self.master.grad = self.grads.partition_grad
        return opt

    # -- the ZeroStrategy protocol (call order: see strategy.py) --------------------------------------
    @property
    def phase(self) -> ReducePhase:
        return self.grads.phase

    def arm(self) -> None:
        self.grads.arm()

    def finish(self) -> None:
        self.grads.finish()

    def disarm(self) -> None:
        self.grads.disarm()

    def clip_and_norm(self, max_norm: float) -> float:
        """Global gradient 2-norm: sqrt of the all-reduced sum of squares of every rank's partition
        (padding is zero, so it adds nothing); equals `clip_grad_norm_` on the full gradient. If
        max_norm > 0 and the norm is finite, scale by min(1, max_norm / (norm + 1e-6)) as torch does."""
        g = self.grads.partition_grad
        sq = torch.linalg.vector_norm(g, dtype=torch.float64).square().reshape(1)
        all_reduce(sq, group=self.group, logger=self.logger)
        norm = math.sqrt(float(sq))
        if max_norm > 0 and math.isfinite(norm):
            coef = torch.tensor(max_norm, dtype=g.dtype) / (torch.tensor(norm, dtype=g.dtype) + 1e-6)
            g.mul_(coef.clamp(max=1.0).to(g.device))
        return norm

    def optimizer_step(self) -> None:
        """Step the optimizer on this rank's partition (in place in the flat buffer), then all-gather
        every chunk so all ranks hold the full updated parameters."""
        if self.optimizer is None:
            return
        self.master.grad = self.grads.partition_grad
        self.optimizer.step()
        self.all_gather_params()

    def all_gather_params(self) -> None:
        """In-place all-gather of each chunk's shards: [L] elements per chunk land on every rank."""
        handles = []
        for c in range(self.layout.num_chunks):
            chunk = self.flat[slice(*self.layout.chunk_range(c))]
            own = self.flat[slice(*self.layout.shard_range(c, self.rank))]
            handles.append(start_all_gather(chunk, own, group=self.group, logger=self.logger))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    def remove(self) -> None:
        """Remove the hooks and drop gradients; parameters stay views into the flat buffer."""
        self.grads.remove_hooks()
        for p in self.params:
            p.grad = None
        self.master.grad = None

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds, measured from the tensors: params = the full flat buffer (Ψ + padding);
        grads = stage 1 the flat gradient buffer (Ψ + padding), stage 2 the partition gradient (Ψ/N)
        plus any scratch held right now (none between backwards); optimizer_states = the optimizer's
        state tensors over the partition (Adam: 2Ψ/N); master_weights = 0 in fp32 because the master
        is a view of the parameters (counted if it ever owns separate storage)."""
        esize = self.flat.element_size()
        shared = self.master.untyped_storage().data_ptr() == self.flat.untyped_storage().data_ptr()
        return {"params": self.flat.numel() * esize, "grads": self.grads.grad_bytes(),
                "optimizer_states": _optimizer_state_bytes(self.optimizer),
                "master_weights": 0 if shared else self.master.numel() * esize}
