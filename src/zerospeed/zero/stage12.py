"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, §5.1 P_os and §5.2 P_os+g), any `MixedPrecisionPolicy`.

Layout (`partition.py`): every trainable parameter becomes a view into one flat buffer of Ψ
elements (+ padding) in the parameter dtype, cut into K equal chunks; rank r owns shard r of each
chunk, so its partition is the strided view `flat.view(K, L)[:, r*S:(r+1)*S]` ([K, S] elements,
S = L / N). This rank's fp32 partition is `master` ([K, S]); the optimizer steps its K rows (`master_params`,
one contiguous [S] view per chunk; with several param groups each row is cut into per-group *segments*,
`param_groups.py`), so the optimizer's per-step temporaries are chunk-sized: one [K, S] tensor made foreach AdamW allocate 4Ψ/N-byte temporaries every step, above
glibc's 32 MiB mmap ceiling and so page-faulted anew each time (356 ms of an 11 s stage-2 step of
the 85M GPT, profiled).
- fp32: `master` *is* that strided view, so no copy exists and the update lands in the flat buffer;
- bf16/fp16: `master` is a separate fp32 [K, S] tensor (4Ψ/N bytes) built from the original fp32
  values; after the step it is copied (rounded) into the low-precision shard of `flat`.
Either way each chunk is then all-gathered in place in the parameter dtype (one collective per
chunk), so every rank holds the full updated parameters.

Gradients (`stage12_grads.py`): reduce-scattered chunk by chunk while backward runs, in the
policy's reduce dtype; this rank's averaged shard ends in `grads.partition_grad` ([K, S], fp32
under mixed precision), which is unscaled (fp16), clipped and handed to the optimizer. Stage 1
keeps the full gradient in the parameter dtype (Ψ), stage 2 only the partition gradient (Ψ/N;
under mixed precision the 2-byte reduced sums until the step converts them, then freed at the step).
Communication per step and rank: reduce-scatter input Ψ (stage 2: Ψ per micro-step) + all-gather
output Ψ elements, i.e. 2Ψ, as for an all-reduce (§7); 2 bytes per element under bf16/fp16.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import GroupCollectives
from ..comm.logger import CommsLogger
from ..offload.aio import HOST
from ..offload.optimizer import SwappedOptimizer
from ..precision import MixedPrecisionPolicy, first_nonfinite
from . import fragments
from . import stage3_context as ctx
from .data_parallel import ReducePhase
from .param_groups import by_group, group_index, merge_segments, retarget, swapped_builder
from .partition import plan_flat_partition
from .stage12_grads import Stage1Grads, Stage2Grads
from .strategy import ZeroStrategy, _optimizer_state_bytes


def new_swapped_optimizer(offload, optimizer, num_groups: int, dtype: torch.dtype) -> SwappedOptimizer:
    """The NVMe optimizer tier (`offload_optimizer.device` "nvme") of `optimizer` (re-targeted to its tiles
    when built; None: no optimizer) with `num_groups` param groups and masters of `dtype`, in `offload`'s
    swap space."""
    policy = offload.policy
    return SwappedOptimizer(make_optimizer=swapped_builder(optimizer), swap=offload.swaps["optimizer"],
                            sub_group_size=policy.sub_group_size, pipeline=policy.pipeline,
                            dtype=dtype, pin=policy.pin_memory, num_groups=num_groups)


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
    """ZeRO stage 1 (optimizer states partitioned) or 2 (+ gradients) over `group`.

    module: the model (already on its device, identical on every rank). params: its trainable
    parameters, deduplicated, in registration order; they become views into one flat buffer.
    optimizer: the user's torch optimizer over `params` (any param groups), or None; it is re-targeted
    (`param_groups.retarget`) to this rank's fp32 partition `master` ([K, S]; in fp32 a strided view of
    the flat buffer): per group, the segments of the K rows that hold its elements (one group: the
    rows themselves, [S] each). reduce_bucket_size /
    allgather_bucket_size: elements; the chunk length L is at most the smaller of the two (0 = no
    all-gather limit) plus N - 1. average: divide the summed gradients by N (`gradient_allreduce_op`
    mean). predivide_factor: DeepSpeed's `gradient_predivide_factor`. policy: the mixed-precision
    policy (parameters must already be in its param_dtype). master_values: {id(param): original
    fp32 value} for the masters (default: the parameters' current values, upcast). offload: an
    `offload.OffloadContext` or None; with `offload_optimizer.device` "cpu" the master is a separate
    fp32 [K, S] tensor on the host (its `.grad` a host copy of the partition gradient), with "nvme"
    it lives in swap files and a `SwappedOptimizer` steps it tile by tile (`master` is then None).
    Raises ValueError (no trainable parameters; wrong optimizer), TypeError (mixed dtypes or devices;
    an optimizer that cannot be built over the partition), NotImplementedError (reduce_scatter=false,
    allgather_partitions=false).
    average_over: divide the summed gradients by this many ranks instead of the group's size (a mixture of
    experts: the expert partition is reduced over the expert-data group but averaged over every data-parallel
    rank, `stage12_grouped.py`). group_of: the optimizer param group of each of `params` when `optimizer` is
    None but a caller re-targets a shared optimizer itself (`GroupedStage12Strategy`); default all group 0.
    swapped: with the optimizer on NVMe, a `SwappedOptimizer` shared with other strategies to add this
    one's master to (its index: `swap_master`); the caller builds and steps it (`swap_grad`,
    `write_swapped`). Default: this strategy's own.
    Source: ZeRO, Rajbhandari et al. 2020, §5.1-5.2.
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter], optimizer, *, stage: int,
                 group: dist.ProcessGroup | None, reduce_bucket_size: int, allgather_bucket_size: int = 0,
                 reduce_scatter: bool = True, allgather_partitions: bool = True, average: bool = True,
                 predivide_factor: float = 1.0, logger: CommsLogger | None = None,
                 policy: MixedPrecisionPolicy | None = None, master_values: dict[int, torch.Tensor] | None = None,
                 offload=None, collectives: type[GroupCollectives] = GroupCollectives,
                 average_over: int | None = None, group_of: list[int] | None = None,
                 swapped: SwappedOptimizer | None = None):
        if stage not in (1, 2):
            raise ValueError(f"Stage12Strategy implements ZeRO stages 1 and 2, not {stage}")
        for key, value in (("reduce_scatter", reduce_scatter), ("allgather_partitions", allgather_partitions)):
            if not value:
                raise NotImplementedError(f"zero_optimization.{key}=false is not supported with stage {stage}: "
                                          f"zerospeed always uses reduce-scatter + all-gather; remove the key")
        self.names = names = _check_params(module, params, stage)
        self.policy = policy = policy or MixedPrecisionPolicy()
        self.stage, self.params, self.group, self.logger = stage, params, group, logger
        self.comms = comms = collectives(group, logger)
        self.reduce_every_micro_step = stage == 2
        self.world, self.rank = comms.world_size, comms.rank
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
        # this rank's shard of the parameters, in their dtype (the all-gather source)
        self.own_params = self.flat.view(layout.num_chunks, layout.chunk_numel)[:, self.rank * s:(self.rank + 1) * s]
        # offload (an OffloadContext): "cpu" keeps a separate fp32 master on the host, "nvme" on disk
        self.offload, self.swapped = offload, None
        self.master_device = HOST if offload is not None and offload.policy.optimizer_on_host else device
        separate = policy.mixed or offload is not None and offload.policy.optimizer_on_host
        self.master = self._build_master(master_values or {}) if separate else self.own_params
        if optimizer is not None:
            group_of = group_index(optimizer, params, names)
        elif group_of is None:
            group_of = [0] * len(params)
        self.segments = merge_segments(((c, a, b, group_of[i]) for c, a, b, i, _ in self.partition_pieces()),
                                       [s] * layout.num_chunks)
        if offload is not None and offload.policy.optimizer == "nvme":
            if swapped is None:
                groups = len(optimizer.param_groups) if optimizer is not None else 1
                swapped = new_swapped_optimizer(offload, optimizer, groups, self.master.dtype)
            self.swapped = swapped
            # one group: tiles of whole partition rows; several: the flat partition cut at every segment
            self._swap_flat = swapped.num_groups > 1
            if self._swap_flat:
                self.swap_master = swapped.add_master(self.master.reshape(-1), ranges=self._flat_ranges())
            else:
                self.swap_master = swapped.add_master(self.master)
            self.master = None  # lives on NVMe now
        self.master_params = self._segment_tensors() if self.master is not None else []
        grads_cls = Stage1Grads if stage == 1 else Stage2Grads
        self.grads = grads_cls(params, layout, names, comms=comms, average=average,
                               predivide=predivide_factor, dtype=dtype, device=device,
                               grad_dtype=policy.master_dtype if policy.mixed else None,
                               reduce_dtype=policy.reduce_dtype, average_over=average_over)
        self.optimizer = self._build_optimizer(optimizer)
        ctx.register_strategy(self)  # found by utils.tensor_fragment (safe_get_full_*)

    def partition_pieces(self):
        """(row, start, end, param index, param_start): each parameter fragment in this rank's partition, as
        columns [start, end) of row `row` ([K, S]) and the flattened parameter's elements from param_start."""
        s = self.layout.shard_numel
        for f in self.layout.fragments(self.rank):
            col = f.partition_offset - f.chunk * s
            yield f.chunk, col, col + f.numel, f.index, f.param_offset

    def _flat_ranges(self) -> list[tuple[int, int, int]]:
        """(start, end, group) over the flattened [K * S] partition: each row's segments, or the whole
        row in group 0 where the row is only padding; every range lies inside one row."""
        s, out = self.layout.shard_numel, []
        for c in range(self.layout.num_chunks):
            row = [(c * s + g.start, c * s + g.end, g.group) for g in self.segments if g.source == c]
            out += row or [(c * s, (c + 1) * s, 0)]
        return out

    def _segment_tensors(self) -> list[torch.Tensor]:
        """The tensor the optimizer steps for each segment: its columns of its master row ([S] for a whole row)."""
        return [self.master[g.source, g.start:g.end] for g in self.segments]

    def _build_master(self, values: dict[int, torch.Tensor]) -> torch.Tensor:
        """fp32 [K, S]: this rank's fragments of every parameter, from the original values (zero padding)."""
        master = torch.zeros(self.layout.num_chunks, self.layout.shard_numel, dtype=self.policy.master_dtype,
                             device=self.master_device)
        flat_master = master.view(-1)
        with torch.no_grad():
            for f in self.layout.fragments(self.rank):
                p = self.params[f.index]
                src = values.get(id(p), p.detach()).reshape(-1)
                flat_master[f.partition_offset:f.partition_offset + f.numel].copy_(
                    src[f.param_offset:f.param_offset + f.numel])
        return master

    def _build_optimizer(self, optimizer):
        if optimizer is None:
            return None
        if self.swapped is not None:
            return self.swapped.build()
        retarget(optimizer, by_group(((g.group, t) for g, t in zip(self.segments, self.master_params)),
                                     len(optimizer.param_groups)))
        self._attach_grad()
        return optimizer

    def _attach_grad(self) -> None:
        """Each segment's .grad: its columns of the partition gradient (copied to the host first when the
        master lives there)."""
        g = self.grads.partition_grad
        if g is not None and g.device != self.master.device:
            g = g.to(self.master.device, non_blocking=True)
        for seg, t in zip(self.segments, self.master_params):
            t.grad = None if g is None else g[seg.source, seg.start:seg.end]

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

    def clip_and_norm(self, max_norm: float, *, loss_scale: float = 1.0) -> float:
        """Divide the partition gradient by `loss_scale`; global gradient 2-norm: sqrt of the
        all-reduced sum of squares of every rank's partition (padding is zero, so it adds nothing);
        equals `clip_grad_norm_` on the full gradient, and is inf/nan on every rank if any rank's
        partition overflowed. If max_norm > 0 and the norm is finite, scale by
        min(1, max_norm / (norm + 1e-6)) as torch does (`zero.clipping.clip_and_norm`)."""
        self.grads.materialize()
        g = self.grads.partition_grad
        if loss_scale != 1.0:
            g.mul_(1.0 / loss_scale)
        return self._norm([g], max_norm, (self.group,))

    def nonfinite_grad_names(self, limit: int = 5) -> list[str]:
        """Parameters with inf/nan in any rank's partition gradient (first `limit`). Collective."""
        self.grads.materialize()
        bad = ~torch.isfinite(self.grads.partition_grad).reshape(-1)
        local = []
        if bool(bad.any()):
            seen = set()
            for f in self.layout.fragments(self.rank):
                if f.index not in seen and bool(bad[f.partition_offset:f.partition_offset + f.numel].any()):
                    seen.add(f.index)
                    local.append((f.index, self.names[f.index]))
        return first_nonfinite(local, group=self.group, limit=limit)

    def optimizer_step(self) -> None:
        """Step the optimizer on this rank's fp32 partition (fp32: in place in the flat buffer; mixed:
        then copied, rounded, into this rank's shard of it), then all-gather every chunk so all ranks
        hold the full updated parameters."""
        if self.optimizer is None:
            return
        self.grads.materialize()  # (a no-op when the engine steps: clip_and_norm did it)
        if self.swapped is not None:  # NVMe: stream the tiles; each lands in this rank's shard of flat
            self.swapped.step([self.swap_grad()], lambda m, rows, values: self.write_swapped(rows, values))
            self.all_gather_params()
            return
        self.prepare_step()
        self.optimizer.step()
        self.finish_step()

    def swap_grad(self) -> torch.Tensor:
        """NVMe: the fp32 partition gradient in the shape of master `swap_master` ([K, S], or [K * S] with
        several param groups)."""
        g = self.grads.partition_grad
        return g.reshape(-1) if self._swap_flat else g

    def write_swapped(self, rows: tuple[int, int], values: torch.Tensor) -> None:
        """NVMe: updated master elements `rows` of `swap_master` (rows of [K, S], or a column range of one
        row in the flat layout) -> this rank's shard of the flat buffer, rounded to the parameter dtype."""
        own = self.own_params
        if self._swap_flat:  # a tile is a column range of one row
            c, a = divmod(rows[0], self.layout.shard_numel)
            own[c, a:a + rows[1] - rows[0]].copy_(values, non_blocking=True)
        else:
            own[rows[0]:rows[1]].copy_(values, non_blocking=True)

    def prepare_step(self) -> None:
        """Before `optimizer.step()` (not NVMe): the fp32 partition gradient is each segment's `.grad`."""
        self.grads.materialize()
        self._attach_grad()

    def finish_step(self) -> None:
        """After `optimizer.step()` (not NVMe): the updated master into this rank's shard of the flat buffer
        (when separate), then the all-gather. Collective over `group`."""
        if self.master is not self.own_params:
            with torch.no_grad():
                self.own_params.copy_(self.master)
        self.all_gather_params()

    def all_gather_params(self) -> None:
        """In-place all-gather of each chunk's shards: [L] elements per chunk land on every rank."""
        handles = []
        for c in range(self.layout.num_chunks):
            chunk = self.flat[slice(*self.layout.chunk_range(c))]
            own = self.flat[slice(*self.layout.shard_range(c, self.rank))]
            handles.append(self.comms.start_all_gather(chunk, own))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        self.grads.zero_grad()
        if self.grads.partition_grad is None:  # mixed precision: the fp32 gradient is freed
            for row in self.master_params:
                row.grad = None

    def remove(self) -> None:
        """Remove the hooks and drop gradients; parameters stay views into the flat buffer."""
        ctx.unregister_strategy(self)
        self.grads.remove_hooks()
        for p in self.params:
            p.grad = None
        for row in self.master_params:
            row.grad = None

    # -- checkpoints (the ZeroStrategy protocol; zero/fragments.py walks the slots) ---------------------
    def checkpoint_params(self) -> list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]:
        """(parameter, shape, master dtype) in `params` order."""
        return [(p, tuple(p.shape), self.master.dtype) for p in self.params]

    def checkpoint_slots(self, names, *, load: bool) -> list[fragments.Slot]:
        """One slot per segment of the partition's K rows (one group: the rows, [S] each); the same
        for writing and loading."""
        params, dtype = self.params, self.master.dtype
        return fragments.segment_slots(self.segments, self.master_params, (
            (c, a, b, fragments.logical(names, params[i], params[i].shape, dtype), p_lo)
            for c, a, b, i, p_lo in self.partition_pieces()))

    def refresh_params_from_master(self) -> None:
        """master -> this rank's shard of the flat buffer (when separate), then all-gather. Collective."""
        with torch.no_grad():
            if self.own_params is not self.master:
                self.own_params.copy_(self.master)
            self.all_gather_params()

    def reduced_grad_pieces(self, key: int) -> list[tuple[int, int, torch.Tensor]] | None:
        """Parameter `key`'s fragments of the partition gradient ([K, S], fp32 after materializing)."""
        self.grads.materialize()
        pg, layout = self.grads.partition_grad, self.layout
        if pg is None:
            return None
        s = layout.shard_numel
        return [(f.param_offset, f.param_offset + f.numel, pg[f.chunk, f.partition_offset - f.chunk * s:
                                                               f.partition_offset - f.chunk * s + f.numel])
                for f in self._fragments_of(key)]

    def _fragments_of(self, index: int) -> list:
        """Parameter `index`'s fragments in this rank's partition (an index built once)."""
        by_param = getattr(self, "_frags_by_param", None)
        if by_param is None:
            by_param = self._frags_by_param = {}
            for f in self.layout.fragments(self.rank):
                by_param.setdefault(f.index, []).append(f)
        return by_param.get(index, [])

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds, measured from the tensors: params = the full flat buffer (Ψ + padding
        elements, 2 or 4 bytes); grads = stage 1 the flat gradient buffer (Ψ + padding, parameter
        dtype; under mixed precision plus the fp32 partition gradient, 4Ψ/N, from clipping to
        zero_grad()), stage 2 the partition gradient (Ψ/N; under mixed precision 2-byte after
        backward, fp32 from clipping to the step, none after it) plus any scratch held right now
        (none between backwards); optimizer_states = the optimizer's state tensors over the partition
        (Adam: 8Ψ/N bytes); master_weights = the fp32 partition under mixed precision (4Ψ/N), 0 in
        fp32 because the master is a view of the parameters."""
        if self.swapped is not None:  # NVMe: only the tile buffers are in memory (counted as states)
            states, masters = self.swapped.resident_bytes(), 0
        else:
            shared = self.master.untyped_storage().data_ptr() == self.flat.untyped_storage().data_ptr()
            states = _optimizer_state_bytes(self.optimizer)
            masters = 0 if shared else self.master.numel() * self.master.element_size()
        return {"params": self.flat.numel() * self.flat.element_size(), "grads": self.grads.grad_bytes(),
                "optimizer_states": states, "master_weights": masters}
