"""Stage 3's side of checkpoints and full-weight export (the `ZeroStrategy` checkpoint protocol).

`Stage3Strategy` delegates here: what this rank owns of the logical state (each gather unit's flat
fp32 shard; the segments the optimizer steps, `zero/fragments.py` walks them), the master ->
parameter refresh after a load, the reduced-gradient pieces `utils.tensor_fragment` reads, and
`UnitGatheredValues`, which gathers one unit at a time so `engine.save_16bit_model` can stream full
parameters without any rank holding the whole model.
"""
from __future__ import annotations

import torch

from . import fragments
from .stage3_params import ParamStatus, ShardedParam, ShardedUnit
from .full_values import FullValues


def checkpoint_params(s) -> list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]:
    """(parameter, full shape, dtype of its unit's fp32 master shard), unit by unit."""
    return [(sp.param, tuple(sp.shape), u.shard.dtype) for u in s.units for sp in u.params]


def checkpoint_slots(s, names: fragments.Names) -> list[fragments.Slot]:
    """One slot per segment of the units' shards (one group: the shards themselves); the segment
    placeholders are bound to their shard columns first (`s.unbind_segments()` drops them)."""
    s.bind_segments()
    units = s.opt_units
    return fragments.segment_slots(s.segments, s.master_params, (
        (src, a, b, fragments.logical(names, sp.param, sp.shape, units[src].shard.dtype), p_lo)
        for i, u in enumerate(units) for src, a, b, sp, p_lo in s.unit_pieces(i, u)))


def refresh_params_from_master(s) -> None:
    """Every unit rounds its master into its low-precision shard (`sync_after_step`, if any); units
    currently gathered are re-gathered if pinned, released otherwise (at rest none is). Collective."""
    with torch.no_grad():
        for u in s.units:
            u.after_step(s.comms)


def reduced_grad_pieces(s, sp: ShardedParam) -> list[tuple[int, int, torch.Tensor]] | None:
    """`sp`'s elements of its unit's fp32 shard gradient (materialized first), or None if it has none."""
    unit = sp.unit
    g = s.unit_grad(unit)
    if g is None:
        return None
    lo, hi = unit.layout.param_shard_range(sp.index, s.rank)
    first = unit.layout.rank_range(s.rank)[0]
    return [(lo, hi, g[sp.offset + lo - first:sp.offset + hi - first])] if hi > lo else []


class UnitGatheredValues(FullValues):
    """`FullValues` at stage 3: keeps exactly one gather unit gathered while its parameters are read.

    `order` puts the tensors no unit manages (buffers, frozen parameters) first, then the managed ones
    unit by unit (stable), so each unit is gathered once. Collective: every rank must walk the same
    units in the same order (value() in `order`, or finish()). A unit this walk gathered is released
    when the walk moves on or closes, unless it was gathered already (pinned by GatheredParameters).
    """

    def __init__(self, strategy, tensors: list[torch.Tensor]):
        super().__init__(tensors)
        self.s, self.unit, self.was_sharded, self.visited = strategy, None, False, set()
        managed = {id(sp.param): (u, sp) for u in strategy.units for sp in u.params}
        self.managed: list[tuple[ShardedUnit, ShardedParam] | None] = [managed.get(id(t)) for t in self.tensors]
        self.order = sorted(self.order, key=lambda i: self.managed[i][0].index if self.managed[i] else -1)

    def shape(self, i: int) -> tuple[int, ...]:
        m = self.managed[i]
        return tuple(m[1].shape) if m else tuple(self.tensors[i].shape)

    def value(self, i: int) -> torch.Tensor:
        m = self.managed[i]
        if m is None:
            return self.tensors[i].detach()
        self._need(m[0])
        return m[1].view.detach()

    def finish(self) -> None:
        """Gather every unit not visited yet, in order (ranks that do not write; a writer after a failure)."""
        for i in self.order:
            m = self.managed[i]
            if m is not None and m[0].index not in self.visited:
                self._need(m[0])

    def _need(self, unit: ShardedUnit) -> None:
        if unit is not self.unit:
            self.close()
            self.unit, self.was_sharded = unit, unit.status is ParamStatus.SHARDED
            self.visited.add(unit.index)
            self.s.scheduler.gather(unit)

    def close(self) -> None:
        unit, self.unit = self.unit, None
        if unit is not None and self.was_sharded and not unit.pins and unit.status is ParamStatus.GATHERED:
            unit.release()
