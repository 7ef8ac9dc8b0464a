"""The NVMe optimizer step overlapped with the backward and the next forward (`offload_optimizer.super_offload`).

DeepSpeed's SuperOffload (0.18+, `SuperOffloadOptimizer_Stage3.partition_grads`) steps each sub-group
on the CPU the moment its gradient partition is complete in the boundary micro-step's backward,
instead of after the whole backward, when gradient clipping is off (the step needs no global
quantity then). We do the same for the NVMe optimizer tier (`SwappedOptimizer`): each master's
tiles are read, stepped and written while the backward of the earlier layers computes, so the
optimizer's swap traffic (12 bytes read and written per element with Adam, ZeRO-Infinity,
Rajbhandari et al. 2021, §5.1 and §6.2) hides under the backward's compute instead of following it,
and the gradient itself never goes to disk.

The backward alone cannot hide all of it: it computes about three quarters of a step's work (with
activation checkpointing: recompute + backward), while during the forward the disk would sit idle.
So the masters whose gradients came first in the previous backward - the last layers, which the next
forward reaches last - up to `defer_fraction` of the elements, are *deferred*: their gradient is written
to disk as without super_offload, and they are stepped during the next forward, each before its
layer's all-gather reads it (`settle(m)`, called from the unit's gather), with the hyperparameters
of the step they belong to (a snapshot of the param groups taken at `engine.step()`).

The pipeline is driven from the training thread, no extra thread: `submit` queues a master's tiles
(an in-memory gradient is held as a view, no copy), and `poll()` - called at every gradient hook and
every layer's forward - moves it on without blocking: a tile whose reads are done is stepped and its
writes issued, a tile whose writes are done frees its buffer set, a queued tile takes a free set and
starts reading. Tiles are stepped in submission order (the compute-parameter callback assembles a
master's tiles in order). When more than `max_pending` masters hold in-memory gradients not yet
stepped, `submit` blocks on the oldest tile (the memory bound: `max_pending` + 1 gradients, and
`sets` buffer sets). `finish()` completes everything queued.

The numbers are those of the step at `engine.step()`: the same gradient values reach the same
elementwise optimizer with the same hyperparameters, tile by tile.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from .aio import aligned_empty, aligned_numel

__all__ = ["BackwardSteps"]


class _Entry:
    __slots__ = ("tile", "grad", "store", "hyper", "set", "reads", "writes", "state")

    def __init__(self, tile: int, grad: torch.Tensor | None = None, store=None, hyper=None):
        self.tile, self.grad, self.store, self.hyper, self.set = tile, grad, store, hyper, None
        self.reads: list = []
        self.writes: list = []
        self.state = "queued"  # queued -> reading -> writing -> (retired)


class BackwardSteps:
    """Tiles of `opt` (a built `SwappedOptimizer` whose states are known) stepped as gradients arrive.

    write_param: as `SwappedOptimizer.step`'s. sets: buffer sets of (master + states + gradient) tile
    buffers (host bytes: sets x (2 + states) x max_tile x 4, allocated once). max_pending: masters whose
    in-memory gradients may be alive (not fully stepped) when `submit` returns. defer_fraction: share of
    the elements (the masters reduced first: the last layers) stepped in the next forward. Counters:
    `stepped` (tiles stepped from in-memory gradients, in backwards), `stepped_deferred` (tiles stepped
    from stored gradients). Raises RuntimeError before the optimizer's first step (its states are not
    known yet: that step runs at `engine.step()`).
    """

    def __init__(self, opt, write_param: Callable, *, sets: int = 3, max_pending: int = 2,
                 defer_fraction: float = 0.0):
        if opt._nstates is None:
            raise RuntimeError("BackwardSteps needs the optimizer's states (after the first step)")
        self.opt, self.write_param, self.max_pending = opt, write_param, max(1, max_pending)
        self.nstates = opt._nstates
        n = aligned_numel(opt.max_tile, opt.dtype)
        self.sets = [[aligned_empty(n, opt.dtype, pin=opt.pin) for _ in range(2 + self.nstates)]
                     for _ in range(max(2, sets))]
        self.defer_fraction = defer_fraction
        self.defer: frozenset[int] = frozenset()  # known from the second backward on (the order is learned)
        self.order: list[int] = []  # masters in the order this backward reduced them
        self.free = list(range(len(self.sets)))
        self.queue: deque[_Entry] = deque()
        self.done: set[int] = set()  # indices (in opt.tiles) of the tiles stepped since `start_backward`
        self.stepped = self.stepped_deferred = 0

    def _deferred_masters(self, order: list[int], fraction: float) -> frozenset[int]:
        """The first masters of a backward's reduction `order` whose elements add up to at most `fraction` of
        all (at least the first one when fraction > 0; never the last: it is the first the forward needs)."""
        total, acc, out = sum(t.numel for t in self.opt.tiles), 0, set()
        for m in order[:-1] if fraction > 0 else []:
            n = sum(self.opt.tiles[i].numel for i in self.opt.tiles_of(m))
            if out and acc + n > fraction * total:
                break
            acc += n
            out.add(m)
        return frozenset(out)

    def resident_bytes(self) -> int:
        """Host bytes of the buffer sets."""
        return sum(b.untyped_storage().nbytes() for s in self.sets for b in s)

    # -- the backward ---------------------------------------------------------------------------
    def start_backward(self) -> None:
        """A boundary backward begins (everything queued before is finished first); the masters to defer
        are chosen from the previous backward's order."""
        self.finish()
        self.done = set()
        if self.order:
            self.defer = self._deferred_masters(self.order, self.defer_fraction)
        self.order = []

    def takes(self, m: int) -> bool:
        """Master m's gradient is ready: True if it is stepped in this backward (not deferred to the next
        forward). Records the reduction order."""
        self.order.append(m)
        return m not in self.defer

    def submit(self, m: int, grad: torch.Tensor) -> None:
        """Queue master m's tiles with its final fp32 gradient `grad` (1-D host tensor of the master's
        numel: unscaled, reduced, accumulated; not modified afterwards)."""
        for t in self.opt.tiles_of(m):
            tile = self.opt.tiles[t]
            self.queue.append(_Entry(t, grad=grad[tile.first_element:tile.first_element + tile.numel].view(tile.shape)))
        self.poll()
        while len({self.opt.tiles[e.tile].master for e in self.queue if e.grad is not None}) > self.max_pending:
            self._advance()

    # -- the next forward -------------------------------------------------------------------------
    def submit_stored(self, m: int, store, hyper: list[dict]) -> None:
        """Queue master m's tiles with its gradient in `store` (a `SwappedGrads`; its rows are read with
        the tile), stepped with the param-group values `hyper` (one dict per group, 'params' left out)."""
        for t in self.opt.tiles_of(m):
            self.queue.append(_Entry(t, store=store, hyper=hyper))
        self.poll()

    def settle(self, m: int) -> None:
        """Block until every queued tile of master m is stepped (its values are final)."""
        mine = set(self.opt.tiles_of(m))
        while any(e.tile in mine and e.state in ("queued", "reading") for e in self.queue):
            self._advance()

    # -- progress ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Move the pipeline on without blocking."""
        for e in self.queue:  # step in order: stop at the first tile not read yet
            if e.state == "queued" or (e.state == "reading" and not all(h.done() for h in e.reads)):
                break
            if e.state == "reading":
                self._step(e)
        self._retire(block=False)
        self._start_reads()

    def finish(self) -> set[int]:
        """Complete every queued tile; returns the indices of the tiles stepped since `start_backward`."""
        while self.queue:
            self._advance()
        return self.done

    def _advance(self) -> None:
        """Make progress on the oldest tile, blocking."""
        e = self.queue[0]
        if e.state == "queued" and not self.free:
            self._retire(block=True)
        elif e.state == "reading":
            self._step(e)
        elif e.state == "writing":
            self._retire(block=True)
        self._start_reads()

    def _start_reads(self) -> None:
        for e in self.queue:
            if not self.free:
                return
            if e.state == "queued":
                e.set = self.free.pop(0)
                tile, bufs = self.opt.tiles[e.tile], self.sets[e.set]
                e.reads = self.opt._read(tile, bufs)
                if e.store is not None:
                    e.reads.append(e.store.read_rows(tile.master, tile.first_element, bufs[-1][:tile.numel]))
                e.state = "reading"

    def _step(self, e: _Entry) -> None:
        for h in e.reads:
            h.wait()
        tile, bufs = self.opt.tiles[e.tile], self.sets[e.set]
        grad = e.grad if e.store is None else e.store.apply_scales(bufs[-1][:tile.numel].view(tile.shape))
        group = self.opt.optimizer.param_groups[tile.group]
        saved = None
        if e.hyper is not None:  # the values of the step this tile belongs to (the scheduler has moved on)
            saved = {k: group[k] for k in e.hyper[tile.group]}
            group.update(e.hyper[tile.group])
        try:
            self.opt._bind(tile, bufs)
            self.opt._step_bound(tile, grad, self.write_param)
            self.opt._unbind(tile)
        finally:
            if saved is not None:
                group.update(saved)
        e.writes = self.opt._write(tile, bufs)
        e.grad, e.reads, e.state = None, [], "writing"
        self.done.add(e.tile)
        if e.store is None:
            self.stepped += 1
        else:
            self.stepped_deferred += 1

    def _retire(self, *, block: bool) -> None:
        """Free the sets of written tiles at the front of the queue (blocking: at least the first)."""
        while self.queue and self.queue[0].state == "writing":
            e = self.queue[0]
            if not block and not all(h.done() for h in e.writes):
                return
            for h in e.writes:
                h.wait()
            self.queue.popleft()
            self.free.append(e.set)
            block = False
