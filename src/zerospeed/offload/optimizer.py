"""ZeRO-Infinity's optimizer tier: fp32 master weights and optimizer states on NVMe, stepped in tiles.

ZeRO-Infinity, Rajbhandari et al. 2021, §5.1 (infinity offload engine) and §6.2 (overlap): the
optimizer states of a rank's partition do not fit in memory, so they live in swap files and the step
streams them through a few host buffers, one *tile* (DeepSpeed's sub-group, `sub_group_size`
elements) at a time: read master + states -> step -> copy the updated values to the compute
parameters -> write master + states back. With `pipeline` the next tile is read and the previous one
written while the current one steps (two buffer sets); without it each tile is read, stepped and
written in turn (one set), as DeepSpeed does with `pipeline_read`/`pipeline_write` false.

The step itself is the user's torch optimizer, unchanged: it is built over one placeholder parameter
per tile, and for each tile the placeholder's `.data` is bound to the master buffer, its state
tensors to the state buffers and its `.grad` to the gradient slice, then `optimizer.step()` runs;
torch skips parameters whose `.grad` is None, so only that tile moves. Elementwise optimizers (Adam,
AdamW, SGD, Adagrad, RMSprop, ...) therefore give exactly the in-memory numbers; an optimizer that
mixes elements across a parameter (LAMB's trust ratio) would see tiles instead of partitions.

A master is any fp32 tensor split along dim 0 (stage 1/2: the [K, S] partition, split by rows;
stage 3: a unit's flat [S] shard, split by elements). Files: one per tile, fields at aligned byte
offsets: field 0 the master, then each elementwise state in name order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .aio import HOST, aligned_empty, aligned_numel
from .grads import SwappedGrads
from .swap import SwapSpace

__all__ = ["SwappedOptimizer"]


@dataclass
class _Tile:
    master: int              # index of the master tensor it belongs to
    rows: tuple[int, int]    # [start, end) along the master's dim 0
    shape: torch.Size        # the tile's shape ([rows, ...])
    param: nn.Parameter      # placeholder the optimizer is keyed by; bound to a buffer while stepping
    key: str
    states: list[str] = field(default_factory=list)  # names of its elementwise states on disk
    group: int = 0           # the optimizer param group its elements belong to

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def first_element(self) -> int:
        """Offset of the tile's first element in its (flattened) master."""
        return self.rows[0] * math.prod(self.shape[1:])


class SwappedOptimizer:
    """The optimizer over masters kept in `swap` (a `SwapSpace`).

    make_optimizer: callable(params) -> torch optimizer (the config's or the client's); params is the
    list of tile placeholders, or with `num_groups` > 1 one param-group dict {"params": [...]} per
    group (tiles never cross a group's range: `add_master(ranges=...)`).
    sub_group_size: elements per tile (at least one row of a master). pipeline: overlap reads and
    writes with the step (two buffer sets instead of one). dtype: the masters' dtype (fp32).
    Usage: `add_master(values)` for each master (written to disk; the caller frees its copy), then
    `build()`, then per optimizer step `step(grads, write_param)`.
    Host memory: (1 + states) x tile elements x 4 bytes per buffer set, e.g. AdamW with the default
    sub_group_size 1e9 on a 1e8-element partition: 3 x 4e8 B = 1.2 GB; sub_group_size 1e7: 120 MB.
    """

    def __init__(self, *, make_optimizer: Callable, swap: SwapSpace, sub_group_size: int, pipeline: bool = False,
                 dtype: torch.dtype = torch.float32, pin: bool = False, num_groups: int = 1):
        self.make_optimizer, self.swap, self.pipeline, self.dtype, self.pin = make_optimizer, swap, pipeline, dtype, pin
        self.num_groups = num_groups
        self.sub_group_size = max(1, int(sub_group_size))
        self.tiles: list[_Tile] = []
        self._by_master: dict[int, list[int]] | None = None  # master -> its tile indices (tiles_of)
        self.master_shapes: list[torch.Size] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self._sets: list[list[torch.Tensor]] = []   # buffer sets: [master, state 0, state 1, ...]
        self._placeholder = torch.empty(0, dtype=dtype, device=HOST)
        self._nstates: int | None = None  # elementwise states per tile, known after the first step

    # -- building -------------------------------------------------------------------------------
    def add_master(self, values: torch.Tensor, ranges: list[tuple[int, int, int]] | None = None) -> int:
        """Cut `values` (a master with its initial values, any device) into tiles along dim 0 and write
        them to disk; returns the master's index. ranges: (start, end, group) along dim 0, in order,
        covering it exactly (default: all of it in group 0); no tile crosses a range. Raises ValueError
        for a 0-d tensor or ranges that do not tile dim 0."""
        if values.dim() == 0:
            raise ValueError("a swapped master must have at least one dimension")
        ranges = ranges or [(0, values.shape[0], 0)]
        if [r[0] for r in ranges[1:]] != [r[1] for r in ranges[:-1]] or ranges[0][0] != 0 or \
                ranges[-1][1] != values.shape[0]:
            raise ValueError(f"ranges {ranges} do not tile dim 0 of a master of shape {tuple(values.shape)}")
        m = len(self.master_shapes)
        self.master_shapes.append(values.shape)
        self._by_master = None
        row = math.prod(values.shape[1:])
        per = max(1, self.sub_group_size // max(row, 1))
        staging = None
        for lo, hi, group in ranges:
            for start in range(lo, hi, per):
                end = min(start + per, hi)
                shape = torch.Size((end - start, *values.shape[1:]))
                tile = _Tile(m, (start, end), shape, nn.Parameter(self._placeholder), f"opt_m{m}_r{start}",
                             group=group)
                self.tiles.append(tile)
                if staging is None or staging.numel() < shape.numel():
                    staging = aligned_empty(aligned_numel(shape.numel(), self.dtype), self.dtype)
                buf = staging[:shape.numel()]
                buf.copy_(values[start:end].reshape(-1))
                self.swap.write(tile.key, buf).wait()
        return m

    def build(self) -> torch.optim.Optimizer:
        """Build the torch optimizer over the tiles' placeholders (call after every add_master)."""
        if self.num_groups == 1:
            params = [t.param for t in self.tiles]
            self.optimizer = self.make_optimizer(params)
        else:
            groups = [[t.param for t in self.tiles if t.group == g] for g in range(self.num_groups)]
            params = [p for g in groups for p in g]
            self.optimizer = self.make_optimizer([{"params": g} for g in groups])
        owned = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(owned) != len(params) or any(a is not b for a, b in zip(owned, params)):
            raise ValueError("with offload_optimizer.device=nvme the optimizer must be built over exactly the "
                             "tensors it is given (one per optimizer tile); a callable optimizer must use its params")
        return self.optimizer

    def tiles_of(self, m: int) -> list[int]:
        """Indices (in `tiles`) of master m's tiles, in row order."""
        if self._by_master is None:
            self._by_master = {}
            for i, t in enumerate(self.tiles):
                self._by_master.setdefault(t.master, []).append(i)
        return self._by_master.get(m, [])

    @property
    def max_tile(self) -> int:
        return max((t.numel for t in self.tiles), default=0)

    def _buffers(self, count: int) -> list[list[torch.Tensor]]:
        """Buffer sets of `count` aligned [max_tile] buffers each (allocated once `count` is known)."""
        sets = 2 if self.pipeline else 1
        if not self._sets or len(self._sets[0]) < count:
            n = aligned_numel(self.max_tile, self.dtype)
            self._sets = [[aligned_empty(n, self.dtype, pin=self.pin) for _ in range(count)] for _ in range(sets)]
        return self._sets

    def _offset(self, f: int) -> int:
        return f * aligned_numel(self.max_tile, self.dtype) * torch.empty(0, dtype=self.dtype).element_size()

    # -- I/O of one tile --------------------------------------------------------------------------
    def _read(self, tile: _Tile, bufs: list[torch.Tensor], grads=None) -> list:
        """Start reading the tile's master and states into `bufs` (and, with swapped `grads`, its
        gradient rows into the set's last buffer)."""
        n = tile.numel
        handles = [self.swap.read(tile.key, bufs[0][:n])]
        handles += [self.swap.read(tile.key, bufs[1 + i][:n], self._offset(1 + i)) for i in range(len(tile.states))]
        if isinstance(grads, SwappedGrads) and grads.has(tile.master):
            handles.append(grads.read_rows(tile.master, tile.first_element, bufs[-1][:n]))
        return handles

    def _tile_grad(self, tile: _Tile, grads, gbuf: torch.Tensor | None) -> torch.Tensor:
        """The tile's gradient [tile.shape]: a slice of grads[m], or (swapped) the rows read into
        `gbuf` with the pending scales applied (zeros for a master no backward reached)."""
        if not isinstance(grads, SwappedGrads):
            return grads[tile.master][tile.rows[0]:tile.rows[1]]
        g = gbuf[:tile.numel].view(tile.shape)
        return grads.apply_scales(g) if grads.has(tile.master) else g.zero_()

    def _write(self, tile: _Tile, bufs: list[torch.Tensor]) -> list:
        n = tile.numel
        handles = [self.swap.write(tile.key, bufs[0][:n])]
        handles += [self.swap.write(tile.key, bufs[1 + i][:n], self._offset(1 + i)) for i in range(len(tile.states))]
        return handles

    # -- the step -----------------------------------------------------------------------------------
    def step(self, grads, write_param: Callable[[int, tuple[int, int], torch.Tensor], None],
             skip: set[int] = frozenset()) -> None:
        """One optimizer step over every tile. grads: a list, grads[m] the gradient of master m (its
        shape, any device; already reduced, unscaled and clipped), or a `SwappedGrads` holding them
        on disk (each tile's rows are read with its master; its `scales` unscale and clip them).
        write_param(m, rows, values): copy the updated master rows `values` ([rows, ...] fp32, host)
        into the compute parameters. skip: indices of tiles already stepped (`BackwardSteps`)."""
        if self.optimizer is None:
            raise RuntimeError("SwappedOptimizer.step() before build()")
        if isinstance(grads, SwappedGrads):
            grads.drain()
        if self._nstates is None:
            self._first_step(grads, write_param)
            return
        tiles = [t for i, t in enumerate(self.tiles) if i not in skip]
        if not tiles:
            return
        swapped = isinstance(grads, SwappedGrads)
        sets = self._buffers(1 + self._nstates + swapped)
        writes: list[list] = [[] for _ in sets]
        reads = self._read(tiles[0], sets[0], grads)
        for i, tile in enumerate(tiles):
            cur, nxt = i % len(sets), (i + 1) % len(sets)
            for h in reads:
                h.wait()
            reads = []
            if self.pipeline and i + 1 < len(tiles):  # read the next tile while this one steps
                for h in writes[nxt]:
                    h.wait()
                writes[nxt] = []
                reads = self._read(tiles[i + 1], sets[nxt], grads)
            self._bind(tile, sets[cur])
            self._step_bound(tile, self._tile_grad(tile, grads, sets[cur][-1] if swapped else None), write_param)
            self._unbind(tile)
            writes[cur] += self._write(tile, sets[cur])
            if not self.pipeline:
                for h in writes[cur]:
                    h.wait()
                writes[cur] = []
                if i + 1 < len(tiles):
                    reads = self._read(tiles[i + 1], sets[nxt], grads)
        for hs in writes:
            for h in hs:
                h.wait()

    def _first_step(self, grads, write_param) -> None:
        """The first step: torch creates the states; learn which are elementwise and write them out."""
        staging = aligned_empty(aligned_numel(self.max_tile, self.dtype), self.dtype)
        gbuf = aligned_empty(self.max_tile, self.dtype) if isinstance(grads, SwappedGrads) else None
        counts = set()
        for tile in self.tiles:
            n = tile.numel
            self.swap.read(tile.key, staging[:n]).wait()
            if gbuf is not None and grads.has(tile.master):
                grads.read_rows(tile.master, tile.first_element, gbuf[:n]).wait()
            tile.param.data = staging[:n].view(tile.shape)
            self._step_bound(tile, self._tile_grad(tile, grads, gbuf), write_param)
            state = self.optimizer.state[tile.param]
            tile.states = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == tile.shape)
            counts.add(len(tile.states))
            self.swap.write(tile.key, staging[:n]).wait()
            for i, name in enumerate(tile.states):  # through the aligned staging buffer: O_DIRECT
                staging[:n].copy_(state[name].detach().reshape(-1))
                self.swap.write(tile.key, staging[:n], self._offset(1 + i)).wait()
            self._unbind(tile)
        if len(counts) > 1:
            raise RuntimeError(f"the optimizer created different numbers of elementwise states per tile ({counts}); "
                               "offload_optimizer.device=nvme needs an elementwise optimizer such as AdamW")
        self._nstates = counts.pop() if counts else 0

    def _bind(self, tile: _Tile, bufs: list[torch.Tensor]) -> None:
        n, state = tile.numel, self.optimizer.state[tile.param]
        tile.param.data = bufs[0][:n].view(tile.shape)
        for i, name in enumerate(tile.states):
            state[name] = bufs[1 + i][:n].view(tile.shape)

    def _unbind(self, tile: _Tile) -> None:
        tile.param.data = self._placeholder
        state = self.optimizer.state[tile.param]
        for name in tile.states:
            state[name] = self._placeholder

    def _step_bound(self, tile: _Tile, g: torch.Tensor, write_param) -> None:
        p = tile.param
        p.grad = g if g.device == HOST and g.dtype == self.dtype else g.to(HOST, self.dtype)
        try:
            self.optimizer.step()
        finally:
            p.grad = None
        write_param(tile.master, tile.rows, p.data)

    # -- masters outside the step -------------------------------------------------------------------
    def read_master(self, m: int) -> torch.Tensor:
        """A fresh host tensor with master m's current values (for state dicts and write-back)."""
        out = torch.empty(self.master_shapes[m], dtype=self.dtype, device=HOST)
        staging = aligned_empty(aligned_numel(self.max_tile, self.dtype), self.dtype)
        for t in self.tiles:
            if t.master == m:
                self.swap.read(t.key, staging[:t.numel]).wait()
                out[t.rows[0]:t.rows[1]].copy_(staging[:t.numel].view(t.shape))
        return out

    def write_master(self, m: int, values: torch.Tensor) -> None:
        """Overwrite master m with `values` (its shape; e.g. a GatheredParameters(modifier_rank) edit)."""
        staging = aligned_empty(aligned_numel(self.max_tile, self.dtype), self.dtype)
        for t in self.tiles:
            if t.master == m:
                staging[:t.numel].copy_(values[t.rows[0]:t.rows[1]].reshape(-1))
                self.swap.write(t.key, staging[:t.numel]).wait()

    # -- accounting ----------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Host bytes of the tile buffers (the only master/state bytes in RAM)."""
        return sum(b.untyped_storage().nbytes() for s in self._sets for b in s)

    def disk_bytes(self, states: int = 2) -> int:
        """Bytes the swap files take (or will take with `states` elementwise states per tile)."""
        count = 1 + (self._nstates if self._nstates is not None else states)
        return len(self.tiles) * count * self._offset(1)
