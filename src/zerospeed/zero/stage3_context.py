"""User-facing ZeRO-3 contexts: `GatheredParameters`, `register_external_parameter`, `unwrap_for_generation`.

DeepSpeed's names and signatures (`deepspeed.zero.GatheredParameters`, `register_external_parameter`,
`unwrap_model_for_generation`); the semantics follow ZeRO, Rajbhandari et al. 2020, §5.3. Every call
here that gathers or re-partitions is a *collective*: call it on every data-parallel rank, in the
same order. Parameters not managed by a live ZeRO-3 strategy (stages 0-2, frozen parameters,
another model) pass through untouched, so the same user code runs at every stage.

Registries (module-level, weak): the live ZeRO strategies of every stage (these contexts act on the
stage-3 ones; `utils.tensor_fragment` finds any stage's), and the external parameters users
register, possibly before the engine exists (DeepSpeed users call `register_external_parameter` in
`__init__`). They key on modules and hold no attributes on any `nn.Parameter`.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import stage3_init as init

_LIVE: list[weakref.ref] = []  # live ZeRO strategies, every stage, oldest first
_EXTERNAL: "weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]]" = weakref.WeakKeyDictionary()


def register_strategy(strategy) -> None:
    """Called by every ZeRO strategy when it starts managing a model (internal)."""
    unregister_strategy(strategy)
    _LIVE.append(weakref.ref(strategy))


def unregister_strategy(strategy) -> None:
    _LIVE[:] = [r for r in _LIVE if r() is not None and r() is not strategy]


def live_strategies(stage: int | None = None) -> list:
    """The live strategies (of `stage`, or all), oldest first."""
    return [s for s in (r() for r in _LIVE) if s is not None and (stage is None or s.stage == stage)]


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered as used by `module`'s forward (possibly empty)."""
    return list(_EXTERNAL.get(module, ()))


def _find(param: torch.Tensor):
    for s in live_strategies(3):
        sp = s.managed(param)
        if sp is not None:
            return s, sp
    return None, None


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Declare that `module`'s forward uses `param` although `param` belongs to another module.

    Under ZeRO-3 the unit holding `param` is then gathered whenever `module`'s forward starts and kept
    until the end of that iteration's backward (or of a no-grad forward). May be called before or
    after `zerospeed.initialize`. Raises TypeError for a non-module / non-parameter argument.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(param, nn.Parameter):
        raise TypeError(f"register_external_parameter: param must be an nn.Parameter, got {type(param).__name__}")
    params = _EXTERNAL.setdefault(module, [])
    if not any(p is param for p in params):
        params.append(param)
    for s in live_strategies(3):
        s.add_external(module, param)


def unregister_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Undo `register_external_parameter(module, param)` (no error if it was not registered)."""
    params = _EXTERNAL.get(module)
    if params is not None:
        params[:] = [p for p in params if p is not param]
    for s in live_strategies(3):
        s.remove_external(module, param)


class GatheredParameters:
    """Temporarily full parameters under ZeRO-3: `with GatheredParameters(params, modifier_rank=0): ...`.

    params: a parameter or an iterable of parameters (DeepSpeed silently ignores a non-iterable; we
    accept a single tensor). On entry every gather unit holding one of them is all-gathered (whole
    units: a unit is one collective) and pinned, so `p.data` has its full shape [*p.shape].
    modifier_rank: None -> edits made inside are discarded on exit (the shards are untouched);
    r -> on exit rank r's full values of those units are broadcast and every rank re-partitions them
    into its shard (so edits made on rank r, e.g. loading weights, take effect everywhere).
    fwd_module: accepted for DeepSpeed compatibility (the units stay gathered for the whole context
    anyway). enabled=False: a no-op. With `zero_optimization.enable_sanity_checks` and modifier_rank=None, a
    parameter changed in place inside the block (its `_version` or data pointer; as DeepSpeed, an edit through
    `.data` is not seen) is a RuntimeError on exit on every rank. Nesting is allowed. Collective on entry and
    exit. Units that were already gathered on entry (inside a forward, say) stay gathered on exit.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params) if enabled and params is not None else []
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self._taken: list = []  # (strategy, units, was_sharded)
        self._init_taken: list = []
        self._versions: list | None = None  # (param, data_ptr, _version) with enable_sanity_checks, modifier None

    def __enter__(self) -> GatheredParameters:
        by_strategy: dict = {}
        for p in self.params:
            s, sp = _find(p)
            if s is not None:
                by_strategy.setdefault(s, {})[sp.unit.index] = sp.unit
        for s, units in by_strategy.items():
            ordered = [units[i] for i in sorted(units)]
            self._taken.append((s, ordered, s.pin(ordered)))
        self._init_taken = init.gather(self.params)  # partitioned by zerospeed.zero.Init, no engine yet
        if self.modifier_rank is None and any(s.scheduler.sanity_checks for s, _, _ in self._taken):
            self._versions = [(p, p.data.data_ptr(), p._version) for p in self.params]  # DeepSpeed's check
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        modifier = self.modifier_rank if exc_type is None else None  # no collective on a failing rank
        modified = self._modified() if self._versions and exc_type is None else False
        init.release(self._init_taken, modifier)
        for s, units, was_sharded in reversed(self._taken):
            s.unpin(units, was_sharded, modifier_rank=modifier)
        self._taken, self._init_taken, self._versions = [], [], None
        if modified:
            raise RuntimeError("Detected in-place modification of ZeRO-3 parameters inside GatheredParameters with "
                               "modifier_rank=None (the edits are discarded). Use modifier_rank=<rank> to broadcast "
                               "updates across ranks. (Checked because zero_optimization.enable_sanity_checks is "
                               "true, as DeepSpeed does.)")

    def _modified(self) -> bool:
        """Whether any rank changed a parameter's data in place (or rebound it) inside the block. Collective over
        the data-parallel group of the first strategy taken."""
        local = any(p.data.data_ptr() != ptr or p._version != version for p, ptr, version in self._versions)
        flag = torch.tensor(int(local), device=self._versions[0][0].device)  # the collective's device (NCCL: GPU)
        group = self._taken[0][0].group
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag)


def _strategy_of(engine_or_module):
    strategy = getattr(engine_or_module, "strategy", None)
    if strategy is not None and getattr(strategy, "stage", None) == 3:
        return strategy
    module = getattr(engine_or_module, "module", engine_or_module)
    for p in module.parameters():
        s, _ = _find(p)
        if s is not None:
            return s
    return None


@contextlib.contextmanager
def unwrap_for_generation(engine_or_module, *, max_bytes: int | None = None) -> Iterator[nn.Module]:
    """Gather the whole model once for generation / evaluation; yields the plain module.

    Autoregressive sampling runs one forward per token; under ZeRO-3 each would all-gather every
    unit (DeepSpeed issue #4354; TRL's fix gathers once, ~10x faster). Inside this context every unit
    is gathered and pinned, so forwards issue no collectives. max_bytes: refuse (ValueError, before
    any collective) if the full model would take more than this many bytes per rank. Collective.
    Works for any stage (a no-op below stage 3). Accepts the engine or the module it wraps.
    """
    module = getattr(engine_or_module, "module", engine_or_module)
    strategy = _strategy_of(engine_or_module)
    if strategy is None:
        yield module
        return
    need = strategy.full_bytes()
    if max_bytes is not None and need > max_bytes:
        raise ValueError(f"unwrap_for_generation: the full model needs {need} bytes per rank, more than "
                         f"max_bytes={max_bytes}; generate without it (one all-gather per unit and forward)")
    with GatheredParameters(strategy.managed_parameters()):
        yield module

