"""What each rank owns of the logical (per-parameter) training state, for topology-independent checkpoints.

A checkpoint stores *logical* tensors: per trainable parameter (keyed by its canonical name in
`module.named_parameters()`, tied weights once) the fp32 master weight and every optimizer state of
the same shape (Adam's `exp_avg`, `exp_avg_sq`), plus 0-d states (Adam's `step`). Each rank writes the
*fragments* it owns: flat element ranges [start, end) of a flattened logical tensor. Ownership:

* stage 0: every rank holds everything; to spread the writing, the parameters are laid back to back
  (registration order) and rank r owns the r-th of N equal contiguous slices of that flat space
  (`stage3_params.flat_layout`). Loading gives every rank every element.
* stages 1/2: the fragments of `FlatPartition.fragments(rank)`: the pieces of parameters inside the
  rank's shard of each chunk; the master is the rank's partition ([K, S]), a fragment is a row slice.
* stage 3: for every gather unit, the pieces of its parameters inside the rank's flat shard.

Loading is the same walk with the ranges this rank owns *now*; the reader returns any flat range of a
logical tensor whatever world size and stage wrote it, so no conversion step exists.

Masters: `_stage0_local`, `_stage12_local` and `_stage3_local` name the tensors the optimizer
updates, the fp32 masters (`strategy.master_params`, cut into per-param-group segments at stages 1-3:
`param_groups.py`; stage 3: each unit's `shard`). In fp32 they
are the parameters / their flat partitions / the unit shards themselves; under bf16/fp16 they are
separate fp32 tensors. After masters are loaded the checkpoint code calls
`strategy.refresh_params_from_master()` (collective), which copies master -> low-precision
parameters (`own_params`, `lp_shard` via `sync_after_step`) and re-gathers, as after a step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .stage3_params import ParamStatus, flat_layout


@dataclass(frozen=True)
class LogicalParam:
    """A trainable parameter as a checkpoint sees it: canonical name, every name (tied weights have
    several; `aliases` excludes `name`), full shape, dtype of the fp32 master."""

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class OwnedFragment:
    """Elements [start, end) of the flattened logical parameter `name` (full shape `shape`) held here.

    master: 1-D view (end - start elements) of the fp32 master; writing into it writes the master.
    states: elementwise optimizer states (same-shape state tensors), 1-D views like `master`.
    scalars: 0-d optimizer states (e.g. Adam's `step`) of the local tensor holding the fragment; only
    on the fragment with start == 0, so every logical parameter stores each scalar exactly once.
    """

    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    master: torch.Tensor
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)


class FragmentReader(Protocol):
    """What `load_owned_fragments` reads from (implemented by the checkpoint reader).

    read(name, field, start, end): 1-D tensor of elements [start, end) of the flattened logical
    tensor `name`'s `field` ("master" or a state name), in the stored dtype, or None if the
    checkpoint does not hold it (a non-strict load keeps the current values). scalar(name, field):
    the 0-d state stored with parameter `name` (None: any parameter's). elementwise_states /
    scalar_states: the state names
    the checkpoint holds (empty when it was saved before the first optimizer step).
    """

    elementwise_states: dict[str, torch.dtype]
    scalar_states: dict[str, torch.dtype]

    def read(self, name: str, field: str, start: int, end: int) -> torch.Tensor | None: ...

    def scalar(self, name: str | None, field: str) -> torch.Tensor: ...


Take = Callable[[torch.Tensor], torch.Tensor]  # local tensor (master or a state of its shape) -> 1-D view


@dataclass
class _Slot:
    """One tensor the optimizer updates (`local`) and the logical fragments inside it."""

    local: torch.Tensor
    frags: list[tuple[LogicalParam, int, int, Take]]  # (param, start, end, take)


def param_names(module: nn.Module) -> dict[int, tuple[str, tuple[str, ...]]]:
    """id(parameter) -> (canonical name, aliases): the first name in `named_parameters()` order wins."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {k: (v[0], tuple(v[1:])) for k, v in names.items()}


def _logical(names, p: torch.Tensor, shape, dtype: torch.dtype) -> LogicalParam:
    name, aliases = names[id(p)]
    return LogicalParam(name, aliases, tuple(shape), dtype)


def _flat_view(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise RuntimeError(f"{what} is not contiguous (strides {t.stride()}); checkpoint fragments are flat views")
    return t.view(-1)


# -- per stage: the optimizer's tensors and the fragments in them --------------------------------------
def _stage0_local(strategy) -> list[torch.Tensor]:
    """One fp32 master per trainable parameter, in `strategy.params` order."""
    return list(getattr(strategy, "master_params", None) or strategy.params)


def _stage0_slots(strategy, names, rank: int, world: int, *, load: bool) -> list[_Slot]:
    masters = _stage0_local(strategy)
    layout = flat_layout([m.numel() for m in masters], world)
    slots = []
    for i, (p, m) in enumerate(zip(strategy.params, masters)):
        lo, hi = (0, m.numel()) if load else layout.param_shard_range(i, rank)
        if hi > lo:
            take = (lambda a, b: lambda t: _flat_view(t, "a stage-0 parameter")[a:b])(lo, hi)
            slots.append(_Slot(m, [(_logical(names, p, p.shape, m.dtype), lo, hi, take)]))
    return slots


def _stage12_local(strategy) -> torch.Tensor:
    """This rank's fp32 master partition, [num_chunks, shard_numel]."""
    return strategy.master


def _segment_slots(strategy, pieces) -> list[_Slot]:
    """One slot per optimizer segment (`strategy.segments`, aligned with `strategy.master_params`, both in
    (source, start) order); `pieces` = (source, col_start, col_end, LogicalParam, param_start) in the same
    order, each inside exactly one segment (`param_groups.merge_segments` guarantees it)."""
    segs, tensors = strategy.segments, strategy.master_params
    frags: list[list] = [[] for _ in segs]
    i = 0
    for source, lo, hi, lp, p_start in pieces:
        while (segs[i].source, segs[i].end) <= (source, lo):
            i += 1
        seg = segs[i]
        take = (lambda a, b: lambda t: t[a:b])(lo - seg.start, hi - seg.start)
        frags[i].append((lp, p_start, p_start + hi - lo, take))
    return [_Slot(t, fr) for t, fr in zip(tensors, frags)]


def _stage12_slots(strategy, names, rank: int, world: int, *, load: bool) -> list[_Slot]:
    """One slot per segment of the partition's K rows (one group: the rows, [S] each)."""
    params, dtype = strategy.params, strategy.master.dtype
    return _segment_slots(strategy, ((c, a, b, _logical(names, params[i], params[i].shape, dtype), p_lo)
                                     for c, a, b, i, p_lo in strategy.partition_pieces()))


def _stage3_local(unit) -> torch.Tensor:
    """The fp32 master of this rank's slice of the unit's flat vector, [shard_numel] (`unit.shard`;
    under mixed precision `unit.lp_shard` is its low-precision copy)."""
    return unit.shard


def _stage3_slots(strategy, names, rank: int, world: int, *, load: bool) -> list[_Slot]:
    """One slot per segment of the units' shards (one group: the shards); placeholders bound first."""
    strategy.bind_segments()
    units = strategy.opt_units
    return _segment_slots(strategy, ((src, a, b, _logical(names, sp.param, sp.shape, units[src].shard.dtype), p_lo)
                                     for i, u in enumerate(units) for src, a, b, sp, p_lo in strategy.unit_pieces(i, u)))


def _slots(strategy, module: nn.Module, *, load: bool) -> list[_Slot]:
    group = getattr(strategy, "group", None)  # the data-parallel group (stage 0 keeps none: the world)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    stage = strategy.stage
    build = _stage0_slots if stage == 0 else _stage12_slots if stage in (1, 2) else _stage3_slots
    return build(strategy, param_names(module), rank, world, load=load)


# -- the ZeroStrategy methods (strategy.py delegates here) ---------------------------------------------
def logical_params(strategy, module: nn.Module) -> list[LogicalParam]:
    """Every trainable parameter, canonical order (same on every rank)."""
    names = param_names(module)
    if strategy.stage == 3:
        return [_logical(names, sp.param, sp.shape, _stage3_local(u).dtype) for u in strategy.units for sp in u.params]
    if strategy.stage in (1, 2):
        return [_logical(names, p, p.shape, _stage12_local(strategy).dtype) for p in strategy.params]
    return [_logical(names, p, p.shape, m.dtype) for p, m in zip(strategy.params, _stage0_local(strategy))]


def _split_state(strategy, local: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(elementwise, scalar) optimizer states of `local`. Raises NotImplementedError for any other kind."""
    opt = strategy.optimizer
    state = opt.state.get(local, {}) if opt is not None else {}
    elem, scal = {}, {}
    for k, v in state.items():
        if v is None:
            continue  # e.g. SGD without momentum
        if torch.is_tensor(v) and v.shape == local.shape:
            elem[k] = v
        elif torch.is_tensor(v) and v.dim() == 0:
            scal[k] = v
        else:
            what = f"a tensor of shape {tuple(v.shape)}" if torch.is_tensor(v) else type(v).__name__
            raise NotImplementedError(
                f"optimizer {type(opt).__name__} keeps state {k!r} as {what} for a tensor of shape "
                f"{tuple(local.shape)}; checkpoints store only per-element states (same shape as the parameter) "
                "and 0-d tensors, so this optimizer's state cannot be resharded")
    return elem, scal


def owned_fragments(strategy, module: nn.Module) -> Iterator[OwnedFragment]:
    """Everything this rank owns, as disjoint fragments: over all ranks they cover each element of
    every logical master / elementwise state exactly once."""
    for slot in _slots(strategy, module, load=False):
        elem, scal = _split_state(strategy, slot.local)
        for lp, start, end, take in slot.frags:
            yield OwnedFragment(lp.name, lp.shape, start, end, take(slot.local.detach()),
                                {k: take(v) for k, v in elem.items()}, dict(scal) if start == 0 else {})


def _copy(dst: torch.Tensor, src: torch.Tensor | None) -> None:
    if src is not None:
        dst.copy_(src)


def load_owned_fragments(strategy, module: nn.Module, reader: FragmentReader, *, optimizer_states: bool = True) -> None:
    """Fill this rank's masters (and, if `optimizer_states` and the checkpoint has them, its optimizer
    states, creating them when the optimizer has not stepped yet) from `reader`. Local only: call
    `refresh_params_from_master()` (collective) afterwards."""
    opt = strategy.optimizer
    states = optimizer_states and opt is not None and bool(reader.elementwise_states or reader.scalar_states)
    with torch.no_grad():
        for slot in _slots(strategy, module, load=True):
            local = slot.local.detach()
            for lp, start, end, take in slot.frags:
                _copy(take(local), reader.read(lp.name, "master", start, end))
            if not states:
                continue
            st = opt.state[slot.local]
            for k, dtype in reader.elementwise_states.items():
                if k not in st or not torch.is_tensor(st[k]) or st[k].shape != local.shape:
                    st[k] = torch.zeros_like(local, dtype=dtype, memory_format=torch.preserve_format)
                for lp, start, end, take in slot.frags:
                    _copy(take(st[k]), reader.read(lp.name, k, start, end))
            source = slot.frags[0][0].name if slot.frags else None
            for k in reader.scalar_states:
                value = reader.scalar(source, k)
                st[k] = value.clone().to(st[k].device if torch.is_tensor(st.get(k)) else local.device)


def refresh_params(strategy) -> None:
    """Make the parameters every rank computes with equal the (just loaded) masters; the same
    master -> parameter path as after `optimizer_step()`. Collective for stages 1-3.

    stage 0: mixed precision copies each master into its parameter (fp32: they are the parameters).
    stages 1/2: master -> this rank's shards of the flat buffer (if separate), then all-gather.
    stage 3: every unit rounds its master into its low-precision shard (`sync_after_step`, if any);
    units currently gathered are re-gathered if pinned, released otherwise (at rest none is)."""
    with torch.no_grad():
        if strategy.stage == 0:
            masters = _stage0_local(strategy)
            for p, m in zip(strategy.params, masters):
                if p is not m:
                    p.data.copy_(m)
        elif strategy.stage in (1, 2):
            own, master = getattr(strategy, "own_params", None), _stage12_local(strategy)
            if own is not None and own is not master:
                own.copy_(master)
            strategy.all_gather_params()
        elif strategy.stage == 3:
            for u in strategy.units:
                u.after_step(strategy.group, strategy.logger)
