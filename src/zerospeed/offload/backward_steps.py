"""The NVMe optimizer step overlapped with the backward (`offload_optimizer.super_offload`).

DeepSpeed's SuperOffload (0.18+, `SuperOffloadOptimizer_Stage3.partition_grads`) steps each sub-group
on the CPU the moment its gradient partition is complete in the boundary micro-step's backward,
instead of after the whole backward, when gradient clipping is off (the step needs no global
quantity then). We do the same for the NVMe optimizer tier (`SwappedOptimizer`): each master's
tiles are read, stepped and written while the backward of the earlier layers computes, so the
optimizer's swap traffic (12 bytes read and written per element with Adam, ZeRO-Infinity,
Rajbhandari et al. 2021, §5.1) hides under the backward's compute instead of following it, and the
gradient itself never goes to disk.

The pipeline is driven from the training thread, no extra thread: `submit(m, grad)` queues master
m's tiles (holding a view of its fp32 gradient, no copy), and `poll()` - called at every parameter's
gradient hook - moves it on without blocking: a tile whose reads are done is stepped and its writes
issued, a tile whose writes are done frees its buffer set, a queued tile takes a free set and
starts reading. Tiles are stepped in submission order (the compute-parameter callback assembles a
master's tiles in order). When more than `max_pending` masters wait with their gradients, `submit`
blocks on the oldest tile (the memory bound: at most `max_pending` gradients + `sets` buffer sets).
`finish()` completes the rest; the tiles of masters that were never submitted (no gradient in this
backward, or a unit still gathered) are stepped by `SwappedOptimizer.step` as usual.

The numbers are those of the step at `engine.step()`: the same gradient values reach the same
elementwise optimizer with the same hyperparameters (the LR scheduler has already moved at the
previous step), tile by tile.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from .aio import aligned_empty, aligned_numel

__all__ = ["BackwardSteps"]


class _Entry:
    __slots__ = ("tile", "grad", "set", "reads", "writes", "state")

    def __init__(self, tile, grad: torch.Tensor):
        self.tile, self.grad, self.set = tile, grad, None
        self.reads: list = []
        self.writes: list = []
        self.state = "queued"  # queued -> reading -> writing -> (retired)


class BackwardSteps:
    """Tiles of `opt` (a built `SwappedOptimizer` whose states are known) stepped as gradients arrive.

    write_param: as `SwappedOptimizer.step`'s. sets: buffer sets of (master + states) tile buffers
    (host bytes: sets x (1 + states) x max_tile x 4, allocated once). max_pending: masters whose
    gradients may wait for a set before `submit` blocks. `stepped` counts the tiles stepped in
    backwards (all steps). Raises RuntimeError before the optimizer's first step (its states are
    not known yet: that step runs at `engine.step()`).
    """

    def __init__(self, opt, write_param: Callable, *, sets: int = 3, max_pending: int = 2):
        if opt._nstates is None:
            raise RuntimeError("BackwardSteps needs the optimizer's states (after the first step)")
        self.opt, self.write_param, self.max_pending = opt, write_param, max(1, max_pending)
        self.nstates = opt._nstates
        n = aligned_numel(opt.max_tile, opt.dtype)
        self.sets = [[aligned_empty(n, opt.dtype, pin=opt.pin) for _ in range(1 + self.nstates)]
                     for _ in range(max(2, sets))]
        self.stepped = 0
        self.reset()

    def reset(self) -> None:
        """Start a new backward (the buffer sets are kept)."""
        self.free = list(range(len(self.sets)))
        self.queue: deque[_Entry] = deque()
        self.done: set[int] = set()    # indices (in opt.tiles) of the tiles stepped
        self.submitted: set[int] = set()  # masters submitted

    def resident_bytes(self) -> int:
        """Host bytes of the buffer sets."""
        return sum(b.untyped_storage().nbytes() for s in self.sets for b in s)

    def submit(self, m: int, grad: torch.Tensor) -> None:
        """Queue master m's tiles with its final fp32 gradient `grad` (1-D host tensor of the master's
        numel: unscaled, reduced, accumulated; not modified afterwards). Raises ValueError for a master
        submitted twice."""
        if m in self.submitted:
            raise ValueError(f"master {m} was already stepped in this backward")
        self.submitted.add(m)
        for t in self.opt.tiles_of(m):
            tile = self.opt.tiles[t]
            g = grad[tile.first_element:tile.first_element + tile.numel].view(tile.shape)
            self.queue.append(_Entry(t, g))
        self.poll()
        while len({self.opt.tiles[e.tile].master for e in self.queue if e.state == "queued"}) > self.max_pending:
            self._advance()

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
        """Complete every submitted tile; returns the indices of the tiles stepped (for `step(skip=)`)."""
        while self.queue:
            self._advance()
        return self.done

    # -- internals ---------------------------------------------------------------------------------
    def _advance(self) -> None:
        """Make progress on the oldest tile, blocking."""
        e = self.queue[0]
        if e.state == "queued":
            if not self.free:
                self._retire(block=True)
            self._start_reads()
        elif e.state == "reading":
            self._step(e)
        else:
            self._retire(block=True)
        self._start_reads()

    def _start_reads(self) -> None:
        for e in self.queue:
            if not self.free:
                return
            if e.state == "queued":
                e.set = self.free.pop(0)
                e.reads = self.opt._read(self.opt.tiles[e.tile], self.sets[e.set])
                e.state = "reading"

    def _step(self, e: _Entry) -> None:
        for h in e.reads:
            h.wait()
        tile, bufs = self.opt.tiles[e.tile], self.sets[e.set]
        self.opt._bind(tile, bufs)
        self.opt._step_bound(tile, e.grad, self.write_param)
        self.opt._unbind(tile)
        e.grad, e.reads = None, []
        e.writes = self.opt._write(tile, bufs)
        e.state = "writing"
        self.done.add(e.tile)
        self.stepped += 1

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
