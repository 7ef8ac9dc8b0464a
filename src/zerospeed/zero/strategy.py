"""The interface between the engine and a ZeRO stage, and stage 0 (plain data parallelism).

The engine only orders calls; a strategy owns gradient storage, reduction, the norm and the
optimizer update for its stage. Per optimizer step the engine calls, in order:

    arm()            at the accumulation boundary, before backward: reduce while backward runs
    finish()         after backward: wait for (and average) every reduction
    clip_and_norm()  unscale by the loss scale, global gradient norm over all ranks' partitions
                     (non-finite = overflow, the same on every rank); clip if max_norm > 0
    optimizer_step() update the fp32 masters (each rank its own partition for stages >= 1), copy
                     them into the low-precision parameters, then all-gather (stages 1-2)
                     -- skipped by the engine when the norm overflowed --
    zero_grad()      clear gradients for the next step
    disarm()         back to accumulating locally

Mixed precision is composed in, not subclassed (DESIGN.md rule 8): every strategy takes a
`MixedPrecisionPolicy`. Names every strategy shares, for checkpointing and tests:

    strategy.policy          the MixedPrecisionPolicy
    strategy.master_params   list of the fp32 tensors the optimizer updates, in its param-group
                             order (stage 0: one per trainable parameter, same order as
                             `strategy.params`; stages 1-2: one [K, S] partition; stage 3: one flat
                             shard per gather unit). In fp32 training these *are* (views of) the
                             parameters; under bf16/fp16 they are separate fp32 tensors built from
                             the original fp32 values. `optimizer.state` is keyed by them.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.collectives import GroupCollectives
from ..comm.logger import CommsLogger
from ..precision import MixedPrecisionPolicy, first_nonfinite, is_nonfinite
from . import fragments
from . import stage3_context as ctx
from .clipping import ModelParallelGrads, clip_and_norm
from .data_parallel import GradientAllReducer, GroupedReducer, ReducePhase
from .full_values import FullValues
from .param_groups import by_group, group_index, retarget
from .partition import plan_one_chunk


class ZeroStrategy(abc.ABC):
    """One ZeRO stage: how gradients are reduced and where parameters and optimizer states live."""

    stage: int
    optimizer: torch.optim.Optimizer | None  # over what this rank updates (its partition for stages >= 1)
    policy: MixedPrecisionPolicy
    master_params: list[torch.Tensor]  # what the optimizer updates (see the module docstring)
    group: dist.ProcessGroup | None  # the data-parallel group its collectives run over (None: the world)
    logger: CommsLogger | None  # the comms logger its collectives report to
    comms: GroupCollectives  # the gradient / parameter collectives over `group` (a subclass may compress)
    swapped = None  # offload.optimizer.SwappedOptimizer when the masters live on NVMe, else None
    # reduce at every micro-step's backward, not only at the accumulation boundary (stage 2: gradients
    # are partitioned as they are produced, so they cannot accumulate locally)
    reduce_every_micro_step: bool = False
    # tensor parallelism: how the gradient is split over the model-parallel group (set by build_strategy)
    model_parallel: ModelParallelGrads | None = None

    def _norm(self, grads: list[torch.Tensor], max_norm: float, groups: tuple, clip=None, **swapped) -> float:
        """`clip_and_norm` of this rank's gradient parts `grads` (disjoint over `groups`), with the
        tensor-parallel group appended and the replicated parameters' pieces (`reduced_grad_pieces`)
        counted once when `model_parallel` is set. clip: what to scale, if not `grads`. swapped:
        `squares` / `on_clip` of the parts on NVMe (`clip_and_norm`)."""
        mp = self.model_parallel
        if mp is None or mp.size == 1:
            return clip_and_norm(grads, max_norm, groups=groups, logger=getattr(self, "logger", None), clip=clip,
                                 **swapped)
        replicated, excluded = [], []
        for p in self.managed_for_norm():
            if (id(p) in mp.replicated or id(p) in mp.excluded) and (where := self.locate(p)) is not None:
                pieces = [t for _, _, t in self.reduced_grad_pieces(where[0]) or []]
                (replicated if id(p) in mp.replicated else excluded).extend(pieces)
        return clip_and_norm(grads, max_norm, groups=(*groups, mp.group), logger=getattr(self, "logger", None),
                             replicated=replicated, replicas=mp.size, excluded=excluded, clip=clip, **swapped)

    def managed_for_norm(self) -> list[torch.Tensor]:
        """The trainable parameters whose gradients this strategy norms (default `self.params`)."""
        return list(self.params)

    @property
    @abc.abstractmethod
    def phase(self) -> ReducePhase: ...

    @abc.abstractmethod
    def arm(self) -> None: ...

    @abc.abstractmethod
    def finish(self) -> None: ...

    @abc.abstractmethod
    def disarm(self) -> None: ...

    def step_in_backward(self) -> bool:
        """Called by the engine before the boundary micro-step's backward when the step needs no global
        quantity (no clipping, no overflow check, loss scale 1): a strategy that can step the optimizer
        during the backward (`offload_optimizer.super_offload`) arms it and returns True. Default: False."""
        return False

    @abc.abstractmethod
    def clip_and_norm(self, max_norm: float, *, loss_scale: float = 1.0) -> float:
        """Divide the reduced gradients by `loss_scale`, return their global 2-norm (inf/nan if
        any rank has a non-finite gradient: the overflow decision) and, if it is finite and
        max_norm > 0, clip them to it. Collective at stages >= 1."""

    @abc.abstractmethod
    def nonfinite_grad_names(self, limit: int = 5) -> list[str]:
        """Names of the first `limit` parameters (in registration order) whose reduced gradient
        holds inf/nan on any rank. Collective at stages >= 1."""

    @abc.abstractmethod
    def optimizer_step(self) -> None: ...

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def remove(self) -> None: ...

    @abc.abstractmethod
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds: {"params", "grads", "optimizer_states", "master_weights"}."""

    # -- checkpoints: what this rank owns of the logical per-parameter state -------------------------
    # Each stage implements the four protocol methods below; zero/fragments.py walks what they return
    # with stage-independent code (it never asks which stage it has).
    @abc.abstractmethod
    def checkpoint_params(self) -> list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]:
        """(model parameter, full shape, master dtype) of every trainable parameter, in the canonical
        order (the same on every rank; stage 3: unit by unit). Local."""

    @abc.abstractmethod
    def checkpoint_slots(self, names: fragments.Names, *, load: bool) -> list[fragments.Slot]:
        """The tensors the optimizer updates (optimizer-state keys), each with the logical fragments of
        `names`' parameters inside it (`fragments.Slot`). load=False: what this rank writes (over all
        ranks of `group` every element exactly once); load=True: what it must fill (stage 0: every
        element; stages 1-3: the same as for writing). Local (stage 3 binds its segment placeholders:
        `release_checkpoint_slots` drops them)."""

    def release_checkpoint_slots(self) -> None:
        """Drop what `checkpoint_slots` bound for the caller (views kept alive). Local; default nothing."""

    @abc.abstractmethod
    def refresh_params_from_master(self) -> None:
        """After the masters changed outside optimizer_step() (a checkpoint load, `safe_set_*`): make the
        parameters used for compute equal them on every rank, by the same master -> parameter path as a
        step (bf16/fp16: copy into the low-precision parameters / shards; stages 1/2 all-gather; stage 3
        re-gathers pinned units). A stage whose step path changes must keep this in line. Collective
        at stages >= 1."""

    def locate(self, param: torch.Tensor):
        """(key, full shape, device) of model parameter `param` if this strategy holds it, else None;
        `key` is what `reduced_grad_pieces` takes, device where a full value of it is assembled. Local.
        Default (stages 0-2): key = the index in `self.params`, device = that of params[0]."""
        index = getattr(self, "_param_index", None)
        if index is None or len(index) != len(self.params):
            index = self._param_index = {id(p): i for i, p in enumerate(self.params)}
        i = index.get(id(param))
        if i is None or self.params[i] is not param:
            return None
        return i, tuple(param.shape), self.params[0].device

    def fragment_group(self, key) -> dist.ProcessGroup | None:
        """The group over which the pieces of parameter `key` (from `locate`) are disjoint and together whole:
        `group`, except where a strategy reduces some parameters over another group (stage 0's experts). Local."""
        return self.group

    @abc.abstractmethod
    def reduced_grad_pieces(self, key) -> list[tuple[int, int, torch.Tensor]] | None:
        """This rank's pieces (start, end, 1-D tensor of end - start elements of the flattened parameter)
        of the reduced fp32 gradient of the parameter `key` (from `locate`), or None if no reduced
        gradient is held. Over all ranks the pieces cover the parameter once. Local."""

    def step_grad_pieces(self, key) -> list[tuple[int, int, torch.Tensor]] | None:
        """The pieces of parameter `key`'s reduced gradient that this rank's optimizer step reads, as
        `reduced_grad_pieces` (writable views: a change is what the step sees). Default: those same pieces
        (stages 1-2: the rank's partition); stage 0 overrides it (every rank steps the whole parameter).
        Local."""
        return self.reduced_grad_pieces(key)

    def full_values(self, tensors: list[torch.Tensor]) -> FullValues:
        """Full values of `tensors` (model parameters and buffers), one at a time, for writing them out
        (`engine.save_16bit_model`); a context manager. Stages 0-2 hold every value whole (nothing
        collective); stage 3 overrides it (gathers one unit at a time, collective)."""
        return FullValues(tensors)

    def logical_params(self, module, translate=None) -> list:
        """Every trainable parameter of `module` as a `fragments.LogicalParam` (canonical name, aliases,
        full shape, master dtype), in the same order on every rank. Local."""
        self._check_checkpointable()
        return fragments.logical_params(self, module, translate)

    def owned_fragments(self, module, translate=None):
        """Yield a `fragments.OwnedFragment` (param name, global shape, flat [start, end), 1-D views of
        the fp32 master and of each same-shape optimizer state, 0-d states on the start == 0 fragment)
        for everything this rank owns; over all ranks they cover every element exactly once
        (stage 0 splits the replicated state into N contiguous slices to spread the writing). Local."""
        self._check_checkpointable()
        return fragments.owned_fragments(self, module, translate)

    def load_owned_fragments(self, module, reader, *, optimizer_states: bool = True, translate=None) -> None:
        """Fill the masters this rank holds now (stage 0: all of them) and, if `optimizer_states`, the
        optimizer states (created if the optimizer has not stepped) from `reader`, any flat range of
        any logical tensor (`fragments.FragmentReader`). Local: call refresh_params_from_master() next.
        translate (here and in logical_params / owned_fragments): tensor-parallel shard -> full-tensor
        coordinates (`runtime.checkpoint_tp.TPTranslation`), or None."""
        self._check_checkpointable()
        fragments.load_owned_fragments(self, module, reader, optimizer_states=optimizer_states, translate=translate)

    def _check_checkpointable(self) -> None:
        if self.swapped is not None:
            raise NotImplementedError(
                "checkpoints with zero_optimization.offload_optimizer.device=nvme are not supported yet: the "
                "master weights and optimizer states live in swap files. Save with device \"cpu\" (or none), or "
                "export the weights with engine.module.state_dict() / save_16bit_model")


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class ExpertGroup:
    """Parameters whose gradients are reduced over another group than the data-parallel one: a mixture of
    experts with expert parallelism (DeepSpeed-MoE, Rajbhandari et al. 2022 §4; GShard §2.2), where each rank
    of an "expert" group holds different experts. `params`: their id()s; summed over `group` (the mesh's
    "expert_data": the ranks holding the same experts) and divided by `average_over` (the data-parallel size:
    the loss is the mean over every data-parallel rank, and each expert's local gradient already sums its
    expert group's tokens through the all-to-all)."""

    params: frozenset
    group: dist.ProcessGroup | None
    average_over: int


class DataParallelStrategy(ZeroStrategy):
    """Stage 0: every rank holds everything; gradients are all-reduced in buckets during backward.

    params: trainable parameters (already in `policy.param_dtype`). optimizer: the user's optimizer
    built over `params` (any param groups; re-targeted to the masters, `param_groups.retarget`), or
    None (inference). group: the data-parallel process group. bucket_size:
    elements (`reduce_bucket_size`). policy: the MixedPrecisionPolicy (default fp32). names:
    parameter names for messages. master_values: {id(param): original fp32 tensor} from
    `MixedPrecisionPolicy.cast_module` (reused as the masters, so no precision is lost at init).

    fp32: the optimizer updates the parameters; `.grad` are views into the all-reduce buckets from a
    backward to the next `zero_grad`, which frees the buckets (`.grad` None, as torch's `set_to_none`).
    bf16/fp16: `master_params` is a full fp32 copy (4Ψ bytes); each low-precision `.grad` is added
    into its bucket and freed by its hook; the buckets are all-reduced in `policy.reduce_dtype` and
    become the masters' `.grad` (fp32); after the step the masters are copied into the parameters.
    With the default 2-byte reduce dtype the buckets stay 2-byte until the step converts them
    (`GradientAllReducer` lazy mode; a second micro-step converts first, so accumulation adds in
    fp32): 2Ψ + 2Ψ + 4Ψ + 8Ψ (Adam) = 16Ψ bytes after backward, the paper's figure (DeepSpeed's
    bf16 optimizer: 20Ψ); with an fp32 `communication_data_type` the buckets are fp32 (4Ψ).
    """

    stage = 0

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None, *,
                 group: dist.ProcessGroup | None,
                 bucket_size: int, average: bool = True, predivide_factor: float = 1.0,
                 logger: CommsLogger | None = None, policy: MixedPrecisionPolicy | None = None,
                 names: list[str] | None = None, master_values: dict[int, torch.Tensor] | None = None,
                 collectives: type[GroupCollectives] = GroupCollectives, experts: ExpertGroup | None = None):
        self.params, self.group, self.logger = params, group, logger
        self.comms = collectives(group, logger)
        self.policy = policy = policy or MixedPrecisionPolicy()
        self.names = names or [f"#{i}" for i in range(len(params))]
        self.reducer = None
        self.experts = experts
        self._ranges: list[tuple[int, int]] | None = None  # `_writer_ranges`, once computed
        expert_idx = [i for i, p in enumerate(params) if experts is not None and id(p) in experts.params]
        if params and (dist.get_world_size(group) > 1 or policy.mixed or expert_idx):
            def reducer(subset, comms, average_over=None):
                return GradientAllReducer(subset, comms=comms, bucket_size=bucket_size, average=average,
                                          predivide_factor=predivide_factor,
                                          grad_dtype=policy.master_dtype if policy.mixed else None,
                                          reduce_dtype=policy.reduce_dtype, average_over=average_over)
            if not expert_idx:
                self.reducer = reducer(params, self.comms)
            else:  # the dense parameters over the data group, the experts over theirs
                dense_idx = sorted(set(range(len(params))) - set(expert_idx))
                parts = [(expert_idx, reducer([params[i] for i in expert_idx], collectives(experts.group, logger),
                                              experts.average_over))]
                if dense_idx:
                    parts.insert(0, (dense_idx, reducer([params[i] for i in dense_idx], self.comms)))
                self.reducer = GroupedReducer(params, parts)
        if policy.mixed and self.reducer is not None:
            values = master_values or {}
            self.master_params = [values[id(p)].to(policy.master_dtype) if id(p) in values else
                                  p.detach().to(policy.master_dtype, copy=True) for p in params]
            self._link_master_grads()
        else:
            self.master_params = params
        self.optimizer = None
        if optimizer is not None:  # each group steps the masters of its own parameters
            groups = group_index(optimizer, params, self.names)
            self.optimizer = retarget(optimizer, by_group(zip(groups, self.master_params), len(optimizer.param_groups)))
        self._phase = ReducePhase.IDLE
        ctx.register_strategy(self)  # found by utils.tensor_fragment (safe_get_full_*)

    @property
    def phase(self) -> ReducePhase:
        return self.reducer.phase if self.reducer is not None else self._phase

    def arm(self) -> None:
        if self.reducer is not None:
            self.reducer.arm()
        else:
            self._phase = ReducePhase.ARMED

    def finish(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()
        else:
            self._phase = ReducePhase.FINISHED

    def disarm(self) -> None:
        if self.reducer is not None:
            self.reducer.disarm()
        self._phase = ReducePhase.IDLE

    def _link_master_grads(self, *, materialize: bool = True) -> None:
        """Mixed precision: each master's `.grad` is its fp32 bucket view (materialized first after a
        reduction: the reducer may hold 2-byte sums until the step); None while the buckets are 2-byte."""
        if not (self.policy.mixed and self.reducer is not None):
            return
        if materialize and self.reducer.phase is ReducePhase.FINISHED:
            self.reducer.materialize()
        ready = self.reducer.grads_ready
        for m, view in zip(self.master_params, self.reducer.grad_views):
            m.grad = view if ready else None

    def clip_and_norm(self, max_norm: float, *, loss_scale: float = 1.0) -> float:
        """Unscale, norm and clip the (already all-reduced, hence identical on every rank) gradients:
        `zero.clipping.clip_and_norm` with no group (no collective). Each gradient goes in flat (a
        view when contiguous, as the bucket views are), so the norm's 64K-element pieces follow the
        bucket, not the rows of a 2-D weight."""
        self._link_master_grads()
        grads = [m.grad for m in self.master_params if m.grad is not None]
        if loss_scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        flat = [g.view(-1) if g.is_contiguous() else g for g in grads]
        if self.experts is not None:
            # expert parallelism: ranks of an expert group hold different experts, so each rank counts the slice
            # of every gradient it owns (`_writer_ranges`: the experts cut over their expert-data group, the rest
            # over the data-parallel group), summed over the data-parallel group: every element once; the whole
            # gradients are clipped
            owned = [m.grad.reshape(-1)[lo:hi] for m, (lo, hi) in zip(self.master_params, self._writer_ranges())
                     if m.grad is not None and hi > lo]  # (the masters' .grad were linked above, once)
            return self._norm(owned, max_norm, (self.group,), clip=flat)
        mp = self.model_parallel
        if mp is None or mp.size == 1:
            return clip_and_norm(flat, max_norm)
        def whole(ids):  # whole here: no writer slices
            return [m.grad for p, m in zip(self.params, self.master_params) if id(p) in ids and m.grad is not None]
        return clip_and_norm(flat, max_norm, groups=(mp.group,), logger=self.logger, replicated=whole(mp.replicated),
                             replicas=mp.size, excluded=whole(mp.excluded))

    def nonfinite_grad_names(self, limit: int = 5) -> list[str]:
        self._link_master_grads()
        local = [(i, n) for i, (m, n) in enumerate(zip(self.master_params, self.names))
                 if m.grad is not None and is_nonfinite(m.grad)]
        return first_nonfinite(local, group=None, limit=limit, collective=False)

    def optimizer_step(self) -> None:
        if self.optimizer is None:
            return
        self._link_master_grads()
        self.optimizer.step()
        if self.policy.mixed:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.master_params)

    def zero_grad(self) -> None:
        if self.reducer is not None:
            self.reducer.zero_grad()
            self._link_master_grads(materialize=False)  # lazy: None until the next reduction is materialized
        else:
            for p in self.params:
                p.grad = None

    def remove(self) -> None:
        ctx.unregister_strategy(self)
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        if self.policy.mixed:
            for m in self.master_params:
                m.grad = None

    # -- checkpoints (the ZeroStrategy protocol; zero/fragments.py walks the slots) ---------------------
    def checkpoint_params(self) -> list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]:
        """(parameter, shape, master dtype) in `params` order."""
        return [(p, tuple(p.shape), m.dtype) for p, m in zip(self.params, self._masters())]

    def _masters(self) -> list[torch.Tensor]:
        """One fp32 master per trainable parameter, in `params` order (fp32: the parameters)."""
        return list(self.master_params or self.params)

    def _writer_ranges(self) -> list[tuple[int, int]]:
        """The flat range of each parameter's master this rank writes: the masters back to back, cut into N
        equal slices, rank r of `group` (N its size) writing slice r of the replicated state. With expert
        parallelism the experts are cut the same way over their own group (the ranks holding the same
        experts), the other parameters over the data-parallel group."""
        if self._ranges is not None:  # fixed for the strategy's life: computed once
            return self._ranges
        masters = self._masters()
        expert = [self.experts is not None and id(p) in self.experts.params for p in self.params]
        out: list[tuple[int, int]] = [(0, 0)] * len(masters)
        for flag, group in ((False, self.group), (True, self.experts.group if self.experts else None)):
            idx = [i for i, e in enumerate(expert) if e == flag]
            if not idx:
                continue
            layout = plan_one_chunk([masters[i].numel() for i in idx], dist.get_world_size(group))
            rank = dist.get_rank(group)
            for j, i in enumerate(idx):
                out[i] = layout.param_shard_range(j, rank)
        self._ranges = out
        return out

    def fragment_group(self, key: int) -> dist.ProcessGroup | None:
        """An expert's pieces (`_writer_ranges`) are cut over its expert-data group, the rest over `group`."""
        if self.experts is not None and id(self.params[key]) in self.experts.params:
            return self.experts.group
        return self.group

    def checkpoint_slots(self, names, *, load: bool) -> list[fragments.Slot]:
        """One slot per parameter master: writing, the part of it inside this rank's slice of the flat
        space (`_writer_ranges`; parameters outside it get no slot); loading, all of it."""
        masters = self._masters()
        ranges = None if load else self._writer_ranges()
        slots = []
        for i, (p, m) in enumerate(zip(self.params, masters)):
            lo, hi = (0, m.numel()) if load else ranges[i]
            if hi > lo:
                take = (lambda a, b: lambda t: fragments.flat_view(t, "a stage-0 parameter")[a:b])(lo, hi)
                slots.append(fragments.Slot(m, [(fragments.logical(names, p, p.shape, m.dtype), lo, hi, take)]))
        return slots

    def refresh_params_from_master(self) -> None:
        """Mixed precision: copy each master into its parameter (fp32: they are the parameters). Local."""
        with torch.no_grad():
            for p, m in zip(self.params, self._masters()):
                if p is not m:
                    p.data.copy_(m)

    def reduced_grad_pieces(self, key: int) -> list[tuple[int, int, torch.Tensor]] | None:
        """The part of parameter `key`'s all-reduced master gradient inside this rank's writer slice
        (the same ownership as the checkpoint's), or None if it has no gradient."""
        self._link_master_grads()  # mixed precision: the masters' fp32 .grad (materialized)
        g = self._masters()[key].grad
        if g is None:
            return None
        lo, hi = self._writer_ranges()[key]
        return [(lo, hi, g.reshape(-1)[lo:hi])] if hi > lo else []

    def step_grad_pieces(self, key: int) -> list[tuple[int, int, torch.Tensor]] | None:
        """The whole all-reduced master gradient of parameter `key` (every rank steps all of it)."""
        self._link_master_grads()
        g = self._masters()[key].grad
        return None if g is None else [(0, g.numel(), g.reshape(-1))]

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes: params (Ψ x 2 or 4), grads (the buckets), optimizer_states, master_weights (4Ψ under
        mixed precision, 0 in fp32 where the parameters are the masters)."""
        grads = self.reducer.bucket_bytes() if self.reducer else \
            _nbytes(p.grad for p in self.params if p.grad is not None)
        return {"params": _nbytes(self.params), "grads": grads,
                "optimizer_states": _optimizer_state_bytes(self.optimizer),
                "master_weights": _nbytes(self.master_params) if self.policy.mixed else 0}
