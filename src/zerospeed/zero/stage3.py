"""ZeRO stage 3: parameters, gradients and optimizer states partitioned over the dp ranks.

ZeRO, Rajbhandari et al. 2020, §5.3 (P_os+g+p). Each rank keeps 1/N of every gather unit
(`stage3_units.py` chooses them: one per transformer block plus a root unit) as a flat fp32 shard
(`stage3_params.py`); the optimizer updates only those shards, so after `optimizer.step()` nothing
needs gathering: the next forward gathers. `stage3_schedule.py` gathers, releases, prefetches and
reduce-scatters units from module and autograd hooks; `stage3_state_dict.py` keeps state dicts full.

After backward a rank holds, in fp32, its shards (4Ψ/N bytes), their gradients (4Ψ/N) and Adam's two
moments (8Ψ/N): 16Ψ/N plus < N padding elements per unit; the step frees the gradients (set to None,
as torch's `zero_grad`), so 12Ψ/N between steps. Under bf16/fp16 (a
`MixedPrecisionPolicy`) each unit's `shard` is the fp32 master and `lp_shard` its 2-byte copy that
the next forward all-gathers; gradients are reduce-scattered in the reduce dtype (2 bytes by
default) and kept so until the step converts them to fp32 (as DeepSpeed does): after backward
2Ψ/N (params) + 2Ψ/N (grads) + 8Ψ/N (Adam) + 4Ψ/N (master) = 16Ψ/N, the paper's figure. With
gradient accumulation the second micro-step converts and micro-steps accumulate in fp32 (4Ψ/N).
Per step, with `stage3_max_reuse_distance` 0: 1 + 2 x blocks all-gathers and one reduce-scatter per
gradient bucket (`reduce_bucket_size` elements of consecutive units), about 3Ψ elements (§7.2.2):
the root is gathered once and held through backward, each block twice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import GroupCollectives
from ..comm.logger import CommsLogger
from ..config.zero import DEFAULT_REDUCE_BUCKET_SIZE
from ..offload.aio import HOST
from ..offload.grads import SwappedGrads
from ..offload.hostmem import GatheredPool, recycled
from ..offload.backward_steps import BackwardSteps
from ..offload.budget import BACKWARD_PENDING, BACKWARD_SETS, FORWARD_SHARE
from ..offload.optimizer import SwappedOptimizer
from ..offload.params import ParamSwapper
from ..precision import MixedPrecisionPolicy, first_nonfinite
from . import stage3_checkpoint as ckpt
from . import stage3_context as ctx
from . import stage3_init as init
from . import stage3_memory
from .data_parallel import ReducePhase
from .param_groups import by_group, group_index, merge_segments, retarget, swapped_builder
from .reduce import gradient_divide_factors
from .stage3_linear import RecycledGradLinears
from .stage3_params import ShardedParam, ShardedUnit
from .stage3_schedule import GatherScheduler, ParameterNotGatheredError
from .stage3_state_dict import StateDictHooks
from .stage3_units import plan_units
from .strategy import ZeroStrategy

__all__ = ["Stage3Strategy", "ParameterNotGatheredError"]


class Stage3Strategy(ZeroStrategy):
    """ZeRO-3 over `module` (fp32). Build with `from_config` (the factory does).

    optimizer: the user's torch optimizer over the module's trainable parameters (any param groups), or
    None; it is re-targeted (`param_groups.retarget`) to the units' flat fp32 shards (one nn.Parameter
    [shard_numel] per unit, `.grad` = the averaged gradient slice), or, where a shard holds several
    groups' elements, to per-group segments of it (placeholders bound to the shard's columns before
    each step: the shard's storage moves while a unit is gathered). group: the data-parallel group.
    persistence_threshold / leaf_*: unit selection (`plan_units`). reduce_bucket_size: elements per
    gradient reduce-scatter: consecutive units' gradients share one until it holds this many (a unit
    larger than it goes alone; default DDP's 25 MiB of fp32, as stages 0-2). prefetch_bucket_size,
    max_live_parameters, max_reuse_distance: elements (`GatherScheduler`). average: divide summed
    gradients by the group size. predivide_factor: divide before the sum, by world/factor after.
    sanity_checks: check every forward for not-gathered parameters (else until one forward passed).
    policy: the mixed-precision policy (the module already cast to its param_dtype). master_values:
    {id(param): original fp32 value} (parameters partitioned by zero.Init bring their own fp32 values).
    `master_params`: what the optimizer updates (fp32 masters: shards or segments), aligned with `segments`.
    memory_efficient_linear: host `nn.Linear` weight gradients into recycled buffers (`stage3_linear`).
    Raises TypeError if a unit mixes dtypes or devices.
    """

    stage = 3
    reduce_every_micro_step = True  # gradients are reduce-scattered at every backward

    def __init__(self, module: nn.Module, optimizer, *, group: dist.ProcessGroup | None,
                 prefetch_bucket_size: int = 50_000_000, max_live_parameters: int = 1_000_000_000,
                 max_reuse_distance: int = 1_000_000_000, persistence_threshold: int = 100_000,
                 reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET_SIZE,
                 leaf_classes=(), leaf_names=(), leaf_name_suffixes=(), average: bool = True,
                 predivide_factor: float = 1.0, logger: CommsLogger | None = None, sanity_checks: bool = False,
                 policy: MixedPrecisionPolicy | None = None, master_values: dict[int, torch.Tensor] | None = None,
                 offload=None, collectives: type[GroupCollectives] = GroupCollectives,
                 memory_efficient_linear: bool = True):
        self.module, self.group, self.logger = module, group, logger
        self.comms = collectives(group, logger)
        self.policy = policy = policy or MixedPrecisionPolicy()
        values = master_values or {}

        def full_value(p):  # zero.Init slices (fp32) first, then the pre-cast original, then the data
            return values[id(p)] if id(p) in values and init.init_shard(p) is None else init.full_value(p)
        self.rank, self.world = self.comms.rank, self.comms.world_size
        self.plans = plan_units(module, persistence_threshold=persistence_threshold, leaf_classes=leaf_classes,
                                leaf_names=leaf_names, leaf_name_suffixes=leaf_name_suffixes,
                                numel_of=lambda p: init.shape_of(p).numel())
        named = dict(module.named_parameters())
        self.offload = offload
        self.swapped, self.param_swapper = self._build_offload(offload, optimizer, named)
        # ZeRO-Infinity: with the optimizer tier on NVMe the fp32 gradients go there too, as produced
        self.grad_store = SwappedGrads(offload.swaps["optimizer"], dtype=policy.master_dtype) \
            if self.swapped is not None else None
        trainable = [(named[n], n) for plan in self.plans for n in plan.params]
        self._group_of = dict(zip((id(p) for p, _ in trainable), group_index(
            optimizer, [p for p, _ in trainable], [n for _, n in trainable]))) if optimizer is not None else {}
        opol = offload.policy if offload is not None else None
        self.units: list[ShardedUnit] = []
        # released full buffers' host memory for the next unit gathered, and per-step buffers (`hostmem`); under
        # offload the per-step buffers are the offload path's cache (its budget counts them), and the pool gives up
        # its idle memory before a cache maps a new buffer (the 4Ψ-capped NVMe test peaks as without the pool)
        self.gathered_pool = GatheredPool() if offload is None else GatheredPool(recycled, recycled)
        if offload is not None:
            self.gathered_pool.watch(recycled)
        for i, plan in enumerate(self.plans):  # one unit at a time, so NVMe offload never holds them all
            u = ShardedUnit(i, plan.name, [(named[n], n, a) for n, a in zip(plan.params, plan.aliases)],
                            rank=self.rank, world=self.world, shape_of=init.shape_of, full_value=full_value,
                            master_dtype=policy.master_dtype if policy.mixed else None,
                            reduce_dtype=policy.reduce_dtype,
                            master_device=HOST if opol is not None and opol.optimizer_on_host else None,
                            param_device=HOST if opol is not None and opol.param == "cpu" else None,
                            param_swapper=self.param_swapper, gathered_pool=self.gathered_pool)
            if self.swapped is not None and u.layout.padded_numel:  # the master goes to NVMe right away, cut by group
                ranges = [(g.start, g.end, g.group) for g in merge_segments(self._grouped(self.unit_pieces(0, u)),
                                                                            [u.layout.shard_numel])]
                u.master_store, u.master_index = self.swapped, self.swapped.add_master(u.shard.detach(),
                                                                                       ranges=ranges or None)
                u.grad_store = self.grad_store
                u.shard.untyped_storage().resize_(0)
            self.units.append(u)
        self._swapped_units = [u for u in self.units if u.master_store is not None]
        # host nn.Linear weight gradients into recycled memory (`stage3_linear`; DeepSpeed's key of the same name)
        self.linears = RecycledGradLinears(module, self.units) if memory_efficient_linear else None
        if self.linears is not None and offload is not None:
            self.gathered_pool.watch(self.linears.cache)
        self._lp_stage: torch.Tensor | None = None  # the swap buffer of the shard whose tiles are being written
        self._backward_steps: BackwardSteps | None = None  # super_offload
        self._deferred: frozenset[int] = frozenset()  # masters whose step waits for the next forward
        self._frozen = [p for p in module.parameters() if not p.requires_grad]
        for p in self._frozen:  # frozen parameters stay whole on every rank (Init may have partitioned them)
            if init.init_shard(p) is not None:
                p.data = init.full_value(p).to(p.dtype, copy=True)
        if self.swapped is not None:
            self.opt_units, self.segments, self.master_params = [], [], []  # on NVMe: keyed by the tiles
            self.optimizer = self.swapped.build() if optimizer is not None else None
        else:
            self._plan_segments(optimizer)
            self.optimizer = None if optimizer is None else retarget(optimizer, by_group(
                ((g.group, t) for g, t in zip(self.segments, self.master_params)), len(optimizer.param_groups)))
        self._phase = ReducePhase.IDLE
        pre, post = gradient_divide_factors(self.world, average=average, predivide_factor=predivide_factor)
        self.scheduler = GatherScheduler(
            module, self.units, comms=self.comms, prefetch_bucket_size=prefetch_bucket_size,
            max_live=max_live_parameters, max_reuse=max_reuse_distance, post=post,
            predivide=pre, sanity_checks=sanity_checks, reduce_bucket_size=reduce_bucket_size,
            max_reduce_in_flight=1 if offload is not None else 2)
        self._state_dict_hooks = StateDictHooks(self)
        self.scheduler.on_forward_start = self._state_dict_hooks.reset
        ctx.register_strategy(self)
        for m in module.modules():
            for p in ctx.external_parameters(m):
                self.add_external(m, p)

    @classmethod
    def from_config(cls, module: nn.Module, optimizer, *, group, zero_cfg, average: bool = True,
                    predivide_factor: float = 1.0, logger: CommsLogger | None = None,
                    policy: MixedPrecisionPolicy | None = None,
                    master_values: dict[int, torch.Tensor] | None = None, offload=None,
                    collectives: type[GroupCollectives] = GroupCollectives) -> Stage3Strategy:
        """Build from the validated `zero_optimization` section (its stage-3 knobs and `leaf_module`)."""
        leaf = zero_cfg.leaf_module
        return cls(module, optimizer, group=group, offload=offload,
                   prefetch_bucket_size=int(zero_cfg.prefetch_bucket_size),
                   max_live_parameters=int(zero_cfg.max_live_parameters),
                   max_reuse_distance=int(zero_cfg.max_reuse_distance),
                   reduce_bucket_size=int(zero_cfg.reduce_bucket_elements),
                   persistence_threshold=int(zero_cfg.param_persistence_threshold), leaf_classes=leaf.classes,
                   leaf_names=leaf.names, leaf_name_suffixes=leaf.name_suffixes, average=average,
                   predivide_factor=predivide_factor, logger=logger, sanity_checks=zero_cfg.enable_sanity_checks,
                   policy=policy, master_values=master_values, collectives=collectives,
                   memory_efficient_linear=zero_cfg.memory_efficient_linear)

    def _plan_segments(self, optimizer) -> None:
        """`segments` (per-group column ranges of each non-empty unit's shard; source = index into
        `opt_units`) and `master_params`, the tensor the optimizer steps for each: the shard itself when
        one group fills it, else a placeholder `bind_segments` points at the shard's columns."""
        self.opt_units = [u for u in self.units if u.layout.padded_numel]
        pieces = (piece for i, u in enumerate(self.opt_units) for piece in self.unit_pieces(i, u))
        self.segments = merge_segments(self._grouped(pieces), [u.layout.shard_numel for u in self.opt_units])
        self.master_params = [self.opt_units[g.source].shard if g.numel == self.opt_units[g.source].layout.shard_numel
                              else torch.empty(0, dtype=self.opt_units[g.source].shard.dtype) for g in self.segments]

    def unit_pieces(self, source: int, u: ShardedUnit):
        """(source, start, end, ShardedParam, param_start): each parameter fragment in this rank's shard of
        unit `u`, as shard columns [start, end) and the flattened parameter's elements from param_start."""
        first = u.layout.rank_range(self.rank)[0]
        for sp in u.params:
            lo, hi = u.layout.param_shard_range(sp.index, self.rank)
            if hi > lo:
                yield source, sp.offset + lo - first, sp.offset + hi - first, sp, lo

    def _grouped(self, pieces):
        """unit_pieces -> (source, start, end, param group) for `merge_segments`."""
        return ((src, a, b, self._group_of.get(id(sp.param), 0)) for src, a, b, sp, _ in pieces)

    def bind_segments(self) -> None:
        """Point every segment placeholder (data and .grad) at its columns of its unit's shard, where the
        shard's storage is now (own storage, or its slice of the gathered buffer)."""
        for g, t in self._placeholders():
            shard = self.opt_units[g.source].shard
            t.data = shard.detach()[g.start:g.end]
            t.grad = None if shard.grad is None else shard.grad[g.start:g.end]

    def unbind_segments(self) -> None:
        """Drop the placeholders' views (so they keep no old shard storage or gradient alive)."""
        for _, t in self._placeholders():
            t.data, t.grad = t.data.new_empty(0), None

    def _placeholders(self):
        """(segment, placeholder) for every segment that is not a whole shard."""
        return [(g, t) for g, t in zip(self.segments, self.master_params) if t is not self.opt_units[g.source].shard]

    def _build_offload(self, offload, optimizer, named):
        """(SwappedOptimizer | None, ParamSwapper | None) for NVMe offload of the masters / the shards."""
        if offload is None:
            return None, None
        pol, swapped, swapper = offload.policy, None, None
        if pol.optimizer == "nvme":
            swapped = SwappedOptimizer(make_optimizer=swapped_builder(optimizer), swap=offload.swaps["optimizer"],
                                       num_groups=len(optimizer.param_groups) if optimizer is not None else 1,
                                       sub_group_size=pol.sub_group_size, pipeline=pol.pipeline,
                                       dtype=self.policy.master_dtype, pin=pol.pin_memory)
        if pol.param == "nvme":
            shards = [-(-sum(init.shape_of(named[n]).numel() for n in plan.params) // self.world)
                      for plan in self.plans]
            big = max(range(len(shards)), key=shards.__getitem__)
            if shards[big] > pol.param_buffer_size:
                raise ValueError(f"offload_param: gather unit '{self.plans[big].name or '<root>'}' has a shard of "
                                 f"{shards[big]:,} elements per rank, more than zero_optimization.offload_param."
                                 f"buffer_size={pol.param_buffer_size:,}; raise buffer_size to at least {shards[big]:,}")
            swapper = ParamSwapper(offload.swaps["param"], buffer_count=pol.param_buffer_count,
                                   buffer_size=shards[big], max_in_cpu=pol.max_in_cpu,
                                   dtype=next(iter(named.values())).dtype, pin=pol.pin_memory)
        return swapped, swapper

    def _write_tile(self, m: int, rows: tuple[int, int], values: torch.Tensor) -> None:
        """SwappedOptimizer callback: updated master elements `rows` of unit m -> its parameter shard."""
        u = self._swapped_units[m]
        if u.swapper is None:
            u.lp_shard[rows[0]:rows[1]].copy_(values)
            return
        if rows[0] == 0:  # an NVMe shard is written whole: its tiles are assembled in its swap buffer first
            self._lp_stage = u.swapper.open_store(u.index)
        self._lp_stage[rows[0]:rows[1]].copy_(values)
        if rows[1] == u.layout.shard_numel:
            u.swapper.close_store(u.index)
            self._lp_stage = None

    # -- lookups and the context API (stage3_context.py calls these) ----------------------------
    def managed(self, param: torch.Tensor) -> ShardedParam | None:
        """The ShardedParam of `param` if this strategy manages it, else None."""
        return self.scheduler.managed.get(id(param)) if self.units else None

    def managed_parameters(self) -> list[nn.Parameter]:
        return [sp.param for u in self.units for sp in u.params]

    def full_bytes(self) -> int:
        """Bytes of every unit's full (padded) buffer: what gathering everything costs per rank."""
        return sum(u.layout.padded_numel * u.full.element_size() for u in self.units)

    def add_external(self, module: nn.Module, param: nn.Parameter) -> bool:
        return self.scheduler.add_external(module, param)

    def remove_external(self, module: nn.Module, param: nn.Parameter) -> None:
        self.scheduler.remove_external(module, param)

    def pin(self, units: list[ShardedUnit]) -> list[bool]:
        return self.scheduler.pin(units)

    def unpin(self, units: list[ShardedUnit], was_sharded: list[bool], *, modifier_rank: int | None) -> None:
        self.scheduler.unpin(units, was_sharded, modifier_rank=modifier_rank)

    # -- ZeroStrategy ---------------------------------------------------------------------------
    @property
    def phase(self) -> ReducePhase:
        return self._phase

    def arm(self) -> None:
        if self._phase is ReducePhase.ARMED:
            raise RuntimeError("Stage3Strategy.arm() called twice without finish()")
        self._settle_all()  # deferred steps of layers this forward did not reach: before any gradient is written
        self._phase = ReducePhase.ARMED

    def finish(self) -> None:
        """Gradients are reduced during backward; flush what a backward did not (e.g. no backward ran)."""
        if self._phase is not ReducePhase.ARMED:
            raise RuntimeError("Stage3Strategy.finish() without arm()")
        self.scheduler.flush()
        self._phase = ReducePhase.FINISHED

    def disarm(self) -> None:
        self._end_backward_steps()  # (a backward that raised: the masters it stepped stay stepped)
        self._phase = ReducePhase.IDLE

    def step_in_backward(self) -> bool:
        """super_offload with the optimizer on NVMe: each master is stepped as its gradient is reduced in
        this backward, the last layers' in the next forward (`offload.backward_steps`), from the second
        step on (the first learns the optimizer's states)."""
        if self.swapped is None or not self.offload.policy.super_offload or self.swapped._nstates is None:
            return False
        if self._backward_steps is None:
            self._backward_steps = BackwardSteps(self.swapped, self._write_tile, sets=BACKWARD_SETS,
                                                 max_pending=BACKWARD_PENDING, defer_fraction=FORWARD_SHARE)
            for u in self._swapped_units:
                u.settle = self._settle_unit
        self._backward_steps.start_backward()
        self.grad_store.consumer = self._backward_steps
        self.scheduler.poll = self._backward_steps.poll
        return True

    def _end_backward_steps(self) -> set[int]:
        """Finish the tiles stepped in the backward (if one is open); returns their indices."""
        if self.grad_store is None or self.grad_store.consumer is None:
            return set()
        self.grad_store.consumer = None
        return self._backward_steps.finish()

    def _defer_steps(self) -> frozenset[int]:
        """After the step: queue the deferred masters that got a gradient, to be stepped during the next
        forward with this step's hyperparameters; returns them."""
        bs = self._backward_steps
        deferred = frozenset(m for m in bs.defer if self.grad_store.has(m) and m not in self.grad_store.consumed)
        if deferred:
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            for m in dict.fromkeys(reversed(bs.order)):  # the forward needs the last reduced first
                if m in deferred:
                    bs.submit_stored(m, self.grad_store, hyper)
        return deferred

    def _settle_unit(self, u: ShardedUnit) -> None:
        if self._backward_steps is not None and self._backward_steps.queue:
            self._backward_steps.settle(u.master_index)

    def _settle_all(self) -> None:
        """Finish every deferred optimizer step (before anything reads all masters or shards)."""
        if self._backward_steps is not None and self._backward_steps.queue:
            self._backward_steps.finish()

    def clip_and_norm(self, max_norm: float, *, loss_scale: float = 1.0) -> float:
        """Divide the shard gradients by `loss_scale`; global 2-norm of the gradient over all ranks'
        shards (= the unsharded norm: shards are disjoint and the padding is zero; inf/nan on every
        rank if any shard overflowed); if it is finite, scale gradients by max_norm / (norm + 1e-6)
        if that is < 1 and max_norm > 0 (torch.nn.utils.clip_grad_norm_'s formula). One 1-element
        all-reduce (`zero.clipping.clip_and_norm`)."""
        self._materialize_grads()
        grads = [u.shard.grad for u in self.units if u.shard.grad is not None and u.shard.numel()]
        if loss_scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        swapped = {}
        if self.grad_store is not None:  # on NVMe: the squares were summed as written; scaling waits for the step
            store = self.grad_store
            squares = store.total_squares()
            if loss_scale != 1.0:
                store.scale_(1.0 / loss_scale)
                squares = squares / loss_scale ** 2
            swapped = {"squares": squares, "on_clip": store.scale_}
        return self._norm(grads, max_norm, (self.group,), **swapped)

    def unit_grad(self, u: ShardedUnit) -> torch.Tensor | None:
        """Unit u's fp32 shard gradient [shard_numel] (read back, scaled, if it is on NVMe), or None."""
        if u.grad_store is None:
            u.materialize_grad()
            return u.shard.grad
        g = u.grad_store.read(u.master_index, u.layout.shard_numel)
        return None if g is None else u.grad_store.apply_scales(g)

    def managed_for_norm(self) -> list[torch.Tensor]:
        return self.managed_parameters()

    def nonfinite_grad_names(self, limit: int = 5) -> list[str]:
        """Parameters with inf/nan in any rank's gradient shard (first `limit`, in unit order). Collective."""
        local = []
        self._materialize_grads()
        bad = set(self.grad_store.nonfinite()) if self.grad_store is not None else set()
        for u in self.units:
            if u.grad_store is not None and u.master_index not in bad:
                continue
            g = self.unit_grad(u)
            if g is None or bool(torch.isfinite(g).all()):
                continue
            start = u.layout.rank_range(self.rank)[0]
            for sp in u.params:
                lo, hi = u.layout.param_shard_range(sp.index, self.rank)
                part = g[sp.offset + lo - start:sp.offset + hi - start]
                if hi > lo and not bool(torch.isfinite(part).all()):
                    local.append(((u.index, sp.index), sp.fqn))
        return first_nonfinite(local, group=self.group, limit=limit)

    def _materialize_grads(self) -> None:
        """Every unit's kept 2-byte gradient becomes its fp32 `shard.grad` (what the step reads)."""
        for u in self.units:
            u.materialize_grad()

    def optimizer_step(self) -> None:
        """Step the optimizer on the shards; units still gathered (pinned) are re-gathered, others released."""
        if self.optimizer is None:
            return
        self._materialize_grads()  # (a no-op when the engine steps: clip_and_norm did it)
        if self.swapped is not None:  # NVMe: stream the tiles; each lands in its unit's parameter shard
            self._settle_all()
            done, deferred = self._end_backward_steps(), frozenset()
            if done:  # super_offload: the tiles stepped in the backward; the deferred ones wait for the forward
                deferred = self._defer_steps()
                done = done | {t for m in deferred for t in self.swapped.tiles_of(m)}
            self.swapped.step(self.grad_store, self._write_tile, skip=done)
            self._deferred = deferred
        else:
            self.bind_segments()
            self.optimizer.step()
            self.unbind_segments()
        for u in self.units:
            u.after_step(self.comms)

    def zero_grad(self) -> None:
        """Drop the shard gradients (set to None, as torch's `zero_grad(set_to_none=True)`: 4Ψ/N bytes
        are free from the step to the next backward) and any full gradients."""
        self._end_backward_steps()
        for u in self.units:
            u.shard.grad = u.lp_grad = None
            for sp in u.params:
                sp.param.grad = None
        if self.grad_store is not None:
            self.grad_store.clear(keep=self._deferred)  # a deferred step reads its gradient in the next forward

    # -- accounting and teardown ----------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]:
        return stage3_memory.memory_breakdown(self)

    # -- checkpoints and full-weight export (the ZeroStrategy protocol; stage3_checkpoint.py) ---------
    def checkpoint_params(self) -> list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]:
        return ckpt.checkpoint_params(self)

    def checkpoint_slots(self, names, *, load: bool) -> list:
        self._settle_all()
        return ckpt.checkpoint_slots(self, names)

    def release_checkpoint_slots(self) -> None:
        self.unbind_segments()

    def refresh_params_from_master(self) -> None:
        self._settle_all()
        ckpt.refresh_params_from_master(self)

    def locate(self, param: torch.Tensor):
        """(its ShardedParam, full shape, the parameter's device) if a unit manages `param`, else None."""
        sp = self.managed(param)
        return None if sp is None else (sp, tuple(sp.shape), param.device)

    def reduced_grad_pieces(self, key: ShardedParam) -> list[tuple[int, int, torch.Tensor]] | None:
        return ckpt.reduced_grad_pieces(self, key)

    def full_values(self, tensors: list[torch.Tensor]) -> ckpt.UnitGatheredValues:
        """Gathers one unit at a time (`stage3_checkpoint.UnitGatheredValues`). Collective."""
        return ckpt.UnitGatheredValues(self, tensors)

    def consolidated_state_dict(self, *, rank: int | None = None) -> dict[str, torch.Tensor]:
        """The model's full state dict (clones in the parameter dtype: bf16/fp16 under mixed precision;
        the fp32 masters are `master_params`), gathered one unit at a time. Collective.
        rank: only that rank keeps the tensors (others get {}); None: every rank does."""
        return self._state_dict_hooks.consolidated(rank=rank)

    def remove(self) -> None:
        """Remove every hook and give each parameter its full value back (a plain module again). Collective.
        With the parameter shards on NVMe (ZeRO-Infinity: the model may not fit in RAM) the parameters
        are left empty instead, as DeepSpeed leaves them partitioned: save the model first
        (`save_16bit_model`, `save_checkpoint`, `consolidated_state_dict`)."""
        self._settle_all()
        self.scheduler.remove()
        self._state_dict_hooks.remove()
        ctx.unregister_strategy(self)
        whole = self.param_swapper is None
        for u in self.units:
            if whole:
                self.scheduler.gather(u)
            for sp in u.params:
                sp.param.data = sp.view.clone() if whole else torch.empty(0, dtype=sp.view.dtype,
                                                                           device=sp.view.device)
                sp.param.grad = None
            u.full.untyped_storage().resize_(0)
        self.units = []
        self.gathered_pool.close()
        if self.linears is not None:
            self.linears.remove()
