"""ZeRO-3 gather scheduling: module and autograd hooks that gather, release, prefetch and reduce units.

The per-module model of FSDP2's `fully_shard` (pre/post forward hooks, a pre-backward hook on each
unit's outputs, post-accumulate-grad hooks, one end-of-backward autograd callback), our own code:

  forward:  unit pre-forward  -> all-gather the unit (waiting on a prefetch if one is in flight),
                                 start prefetching the next units of the recorded order
            unit post-forward -> release (unless reused soon), and hook the outputs so the first
                                 gradient reaching them re-gathers the unit
  backward: pre-backward      -> all-gather the unit again, prefetch the previous units
            post-accumulate   -> when every parameter of the unit has its gradient: release the unit
                                 and add it to the reduce bucket; a bucket holding `reduce_bucket_size`
                                 elements is reduce-scattered (one collective for its units), and its
                                 units' full gradients are dropped
            end of backward   -> flush units whose gradients never all arrived and the open bucket,
                                 wait, average and accumulate into `shard.grad`, release whatever is
                                 still gathered

The root unit is gathered at the start of the root forward and held until its gradients are reduced
at the end of backward. Every rank runs the same hooks in the same order (same model), so the
collectives, prefetches included, match across ranks. Knobs (elements): `prefetch_bucket_size` - how
far ahead to prefetch along the previous forward's unit order (as in DeepSpeed, gathers start while fewer
elements than this are being prefetched, so the next unit is prefetched even when it alone is larger:
HF's "auto", 0.9 h^2, is below one transformer block's 12 h^2); `max_live` - no prefetch, and no
keeping a unit after its forward, that would put more than this many elements in gathered buffers
(room is left for the next unit; a unit needed now is always gathered); `max_reuse` - keep a unit
gathered after forward if fewer elements (2 x the units after it in the order) are gathered before
its backward reuses it. `peak_live` records the most elements gathered at once, `prefetched` the units
gathered ahead of their use.
ZeRO, Rajbhandari et al. 2020, §5.3 and §7.2.2.
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd import Variable
from torch.overrides import TorchFunctionMode

from ..comm.collectives import GroupCollectives
from ..comm.inflight import ReduceQueue
from ..comm.ops import broadcast
from .stage3_params import ParamStatus, ShardedParam, ShardedUnit, start_bucket_reduce

SHARDED, GATHERING, GATHERED = ParamStatus.SHARDED, ParamStatus.GATHERING, ParamStatus.GATHERED


class ParameterNotGatheredError(RuntimeError):
    """A ZeRO-3 parameter was used while only its shard exists (outside its unit's forward)."""


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _grad_tensors(output) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


class _ShardedUseCheck(TorchFunctionMode):
    """Active during checked forwards: a torch op receiving a not-gathered managed parameter raises
    ParameterNotGatheredError naming it (instead of a shape error on the 0-element placeholder)."""

    def __init__(self, scheduler: GatherScheduler):
        super().__init__()
        self.scheduler = scheduler

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in ("__get__", "__set__"):  # our own .data swaps
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, nn.Parameter):
                        sp = self.scheduler.managed.get(id(t))
                        if sp is not None and sp.status is not GATHERED:
                            raise ParameterNotGatheredError(self.scheduler.not_gathered_message(sp, func))
        return func(*args, **kwargs)


class GatherScheduler:
    """Drives the units of one Stage3Strategy through forward and backward (hooks on `module`).

    units: root first. comms: the collectives over the data-parallel group (gathers and gradient
    reduce-scatters; the GatheredParameters broadcast uses its group and logger). post: divisor
    applied to reduced gradients (world size to average); predivide: divisor applied before the
    reduction. sanity_checks: check every forward for
    not-gathered parameters (otherwise only until one forward completed). max_reduce_in_flight: launched
    reduce-scatter buckets not yet finished, at most (a new bucket is filled beside them: 1 under offload
    keeps two buckets alive in the backward instead of three, 76 MB less at the 4Ψ-capped NVMe test's peak).
    """

    def __init__(self, module: nn.Module, units: list[ShardedUnit], *, comms: GroupCollectives,
                 prefetch_bucket_size: int, max_live: int, max_reuse: int,
                 post: float, predivide: float, sanity_checks: bool, reduce_bucket_size: int = 1,
                 max_reduce_in_flight: int = 2):
        self.module, self.units, self.root = module, units, units[0]
        self.comms, self.group, self.logger = comms, comms.group, comms.logger
        self.world = comms.world_size
        self.prefetch_bucket_size, self.max_live, self.max_reuse = prefetch_bucket_size, max_live, max_reuse
        self.post, self.predivide, self.sanity_checks = post, predivide, sanity_checks
        self.reduce_bucket_size = reduce_bucket_size
        self.managed: dict[int, ShardedParam] = {id(sp.param): sp for u in units for sp in u.params}
        self._order: list[int] = []        # unit indices in this forward's order
        self._last_order: list[int] = []   # ... in the previous forward's (drives prefetch and reuse)
        self._order_ok = False             # this forward follows the previous one so far
        self._active: list[tuple[ShardedUnit, int]] = []
        self._bwd_pos = 0
        self._ran: set[int] = set()        # units whose forward ran with grad since the last reduction
        self._reduced: set[int] = set()
        self._grads_ready = [0] * len(units)
        self._pending = ReduceQueue(max_reduce_in_flight)  # launched buckets, finished in launch order
        self._bucket: list[ShardedUnit] = []  # units whose full gradients wait for the next bucket
        self._bucket_numel = 0
        self._held: list[ShardedUnit] = []  # gathered for external parameters until the iteration ends
        self._callback_task: int | None = None
        self._depth = 0
        self._check: _ShardedUseCheck | None = None
        self._checked = False
        self._external: dict[nn.Module, list[ShardedUnit]] = {}
        self.peak_live = 0  # most elements gathered at once so far (full buffers, padded)
        self.prefetched = 0  # units whose gather was started ahead of their use (counter, tests and benchmarks)
        self.on_forward_start = lambda: None
        self.poll = None  # called at every gradient hook and unit forward (super_offload's `BackwardSteps.poll`)
        modules = dict(module.named_modules())
        self.hooks = [module.register_forward_pre_hook(self._root_pre_forward),
                      module.register_forward_hook(self._root_post_forward, always_call=True)]
        for u in units[1:]:
            m = modules[u.name]
            self.hooks += [m.register_forward_pre_hook(functools.partial(self._unit_pre_forward, u)),
                           m.register_forward_hook(functools.partial(self._unit_post_forward, u))]
        for sp in self.managed.values():
            self.hooks.append(sp.param.register_post_accumulate_grad_hook(functools.partial(self._on_grad, sp)))

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def not_gathered_message(self, sp: ShardedParam, func=None) -> str:
        owner = sp.fqn.rpartition(".")[0]
        running = f" while unit '{self._active[-1][0].name}' runs its forward" if self._active else ""
        used = f" by {getattr(func, '__name__', func)}" if func is not None else ""
        return (f"ZeRO-3: parameter '{sp.fqn}' (of module '{owner or '<root>'}', gather unit "
                f"'{sp.unit.name or '<root>'}') was used{used}{running}, but it is {sp.status.value}: this rank "
                f"holds only its 1/{self.world} shard. A module's forward used a parameter it does not own. Call "
                f"zerospeed.zero.register_external_parameter(<that module>, <the parameter>) once after building "
                f"the model, or wrap the use in `with zerospeed.zero.GatheredParameters([param]):`.")

    # -- gather / release -----------------------------------------------------------------------
    def gather(self, u: ShardedUnit) -> None:
        """Make `u` GATHERED now (a collective unless it already is or is in flight)."""
        if u.status is SHARDED:
            self._start(u)
        if u.status is GATHERING:
            u.finish_gather()

    def _start(self, u: ShardedUnit) -> None:
        u.start_gather(self.comms)
        self.peak_live = max(self.peak_live, self._live())

    def _live(self) -> int:
        return sum(u.layout.padded_numel for u in self.units if u.status is not SHARDED)

    def _release(self, u: ShardedUnit) -> None:
        if u.status is GATHERING:
            u.finish_gather()
        if u.status is GATHERED:
            u.release()

    def _prefetch(self, order: list[int], pos: int, step: int) -> None:
        budget, j = 0, pos + step
        while self.prefetch_bucket_size > 0 and 0 <= j < len(order):
            u = self.units[order[j]]
            j += step
            if u.status is not SHARDED or u.index in self._reduced:
                continue
            n = u.layout.padded_numel
            # DeepSpeed's rule: start gathers while fewer than prefetch_bucket_size elements are on their way
            # (the last one may pass it), so a unit larger than the bucket is still prefetched; max_live is hard
            if budget >= self.prefetch_bucket_size or self._live() + n > self.max_live:
                break
            self._start(u)
            self.prefetched += 1
            budget += n

    def _keep_after_forward(self, u: ShardedUnit, pos: int) -> bool:
        if u.pins or any(a is u for a, _ in self._active):
            return True
        if not torch.is_grad_enabled() or not self._order_ok or pos >= len(self._last_order):
            return False
        after = self._last_order[pos + 1:]
        reuse = 2 * sum(self.units[k].layout.padded_numel for k in after)
        upcoming = self.units[after[0]] if after else None  # leave room to gather the next unit
        room = upcoming.layout.padded_numel if upcoming is not None and upcoming.status is SHARDED else 0
        return reuse < self.max_reuse and self._live() + room <= self.max_live

    def _release_idle(self) -> None:
        for u in self._held:
            u.pins -= 1
        self._held = []
        for u in self.units:
            if not u.pins:
                self._release(u)

    # -- forward hooks --------------------------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        if _in_backward():  # activation-checkpoint recomputation
            self.gather(self.root)
            return
        self.on_forward_start()
        self._depth += 1
        if self._depth > 1:
            return
        self._order, self._order_ok, self._active = [], True, []
        self._callback_task = None  # no backward runs now (a backward that raised never ended)
        if self.sanity_checks or not self._checked:
            self._check = _ShardedUseCheck(self)
            self._check.__enter__()
        self.gather(self.root)
        self._prefetch(self._last_order, -1, +1)

    def _root_post_forward(self, module, args, output):
        if _in_backward():
            return None
        self._depth = max(self._depth - 1, 0)
        if self._depth:
            return None
        failed = output is None and sys.exc_info()[1] is not None  # always_call after an exception
        if self._check is not None:
            self._check.__exit__(None, None, None)
            self._check = None
            self._checked = self._checked or not failed
        if failed:
            return None
        self._last_order = self._order
        tensors = _grad_tensors(output) if torch.is_grad_enabled() else []
        if tensors:
            self._ran.add(self.root.index)
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._pre_backward, self.root), mode="any")
        else:  # no backward will follow: nothing needs to stay gathered
            self._release_idle()
        return None

    def _unit_pre_forward(self, u: ShardedUnit, module, args) -> None:
        if self.poll is not None:  # (also the forward: deferred optimizer steps progress here)
            self.poll()
        if _in_backward():
            self.gather(u)
            return
        pos = len(self._order)
        self._order.append(u.index)
        self._order_ok = self._order_ok and pos < len(self._last_order) and self._last_order[pos] == u.index
        self._active.append((u, pos))
        self.gather(u)
        if self._order_ok:
            self._prefetch(self._last_order, pos, +1)

    def _unit_post_forward(self, u: ShardedUnit, module, args, output):
        if _in_backward():
            return None
        pos = self._active.pop()[1] if self._active and self._active[-1][0] is u else len(self._order) - 1
        if torch.is_grad_enabled():
            self._ran.add(u.index)
            tensors = _grad_tensors(output)
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, functools.partial(self._pre_backward, u),
                                                              mode="any")
        if not self._keep_after_forward(u, pos):
            self._release(u)
        return None

    def _external_pre_forward(self, module, args) -> None:
        for u in self._external.get(module, ()):
            self.gather(u)
            if not _in_backward() and not any(h is u for h in self._held):
                u.pins += 1
                self._held.append(u)

    def add_external(self, module: nn.Module, param: nn.Parameter) -> bool:
        """Gather `param`'s unit whenever `module`'s forward runs (see register_external_parameter)."""
        sp = self.managed.get(id(param))
        if sp is None or not any(m is module for m in self.module.modules()):
            return False
        if module not in self._external:
            self._external[module] = []
            self.hooks.append(module.register_forward_pre_hook(self._external_pre_forward))
        if sp.unit not in self._external[module]:
            self._external[module].append(sp.unit)
        return True

    def remove_external(self, module: nn.Module, param: nn.Parameter) -> None:
        sp = self.managed.get(id(param))
        if sp is not None and module in self._external and sp.unit in self._external[module]:
            self._external[module].remove(sp.unit)

    # -- backward hooks -------------------------------------------------------------------------
    def _queue_end_of_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        # only the outermost backward: a reentrant checkpoint runs a nested one inside it
        if task != -1 and self._callback_task is None:
            self._callback_task = task
            self._bwd_pos = len(self._order)
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _pre_backward(self, u: ShardedUnit, *unused) -> None:
        self._queue_end_of_backward()
        self.gather(u)
        pos = len(self._order)
        if u is not self.root:
            j = min(self._bwd_pos, len(self._order)) - 1
            while j >= 0 and self._order[j] != u.index:
                j -= 1
            if j < 0:
                return
            pos = self._bwd_pos = j
        self._prefetch(self._order, pos, -1)

    def _on_grad(self, sp: ShardedParam, param: torch.Tensor) -> None:
        self._queue_end_of_backward()
        if self.poll is not None:
            self.poll()
        u = sp.unit
        self._grads_ready[u.index] += 1
        if self._grads_ready[u.index] >= len(u.params) and u.index not in self._reduced:
            self._reduce(u)

    def _reduce(self, u: ShardedUnit) -> None:
        """u's gradients are complete: put the unit in the open bucket (launched first if u would
        overflow it, and right after if u fills it) and release the unit; its full gradients stay on
        the parameters until the bucket is launched."""
        if u.status is GATHERING:
            u.finish_gather()
        n = u.layout.padded_numel
        if self._bucket and self._bucket_numel + n > self.reduce_bucket_size:
            self._launch_bucket()
        self._bucket.append(u)
        self._bucket_numel += n
        self._reduced.add(u.index)
        self._ran.discard(u.index)
        self._grads_ready[u.index] = 0
        if not u.pins and not any(a is u for a, _ in self._active):
            self._release(u)
        if self._bucket_numel >= self.reduce_bucket_size:
            self._launch_bucket()

    def _launch_bucket(self) -> None:
        if self._bucket:
            handle, pieces = start_bucket_reduce(self._bucket, comms=self.comms, predivide=self.predivide)
            self._pending.push(handle, functools.partial(self._finish_reduce, pieces))
            self._bucket, self._bucket_numel = [], 0

    def _finish_reduce(self, pieces) -> None:
        """A bucket's reduce-scatter is done: add each unit's reduced slice into its gradient shard."""
        for u, out in pieces:
            u.accumulate(out, self.post)

    def flush(self) -> None:
        """Reduce every unit that ran forward or got gradients but was not reduced (zeros for missing
        gradients), in one order on every rank, and wait for all reductions."""
        todo = self._ran | {i for i, n in enumerate(self._grads_ready) if n}
        for i in sorted(todo, reverse=True):
            if i not in self._reduced:
                self._reduce(self.units[i])
        self._launch_bucket()
        self._pending.wait_all()
        self._ran.clear()
        self._reduced.clear()

    def _end_of_backward(self) -> None:
        self._callback_task = None
        self.flush()
        self._release_idle()

    # -- GatheredParameters support -------------------------------------------------------------
    def pin(self, units: list[ShardedUnit]) -> list[bool]:
        """Gather and pin `units` (index order); returns which were sharded before. Collective. The
        shards keep their own storage while pinned: edits of the full values reach them only through
        `write_back` (modifier_rank), never by aliasing."""
        was = [u.status is SHARDED for u in units]
        for u in units:
            self.gather(u)
            u.own_shard_storage()
            u.pins += 1
        return was

    def unpin(self, units: list[ShardedUnit], was_sharded: list[bool], *, modifier_rank: int | None) -> None:
        """Undo `pin`; with modifier_rank, broadcast that rank's full values and re-partition. Collective."""
        for u, was in zip(units, was_sharded):
            if modifier_rank is not None and u.layout.padded_numel:
                u.sync_rebound()  # a re-bound p.data on the modifier rank
                broadcast(u.full, modifier_rank, group=self.group, logger=self.logger)  # rank in the group
                u.write_back()
            u.pins -= 1
            if was and not u.pins and not any(a is u for a, _ in self._active):
                self._release(u)
