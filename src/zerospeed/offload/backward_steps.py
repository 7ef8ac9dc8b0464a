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

The tiles are stepped on one worker thread (`zerospeed-backward-steps`), in submission order: it
starts a queued tile's reads as soon as a buffer set is free, steps it the moment its reads are done,
issues its writes and frees the set when they are done, so the disk never waits for the training
thread to reach a hook (measured, session 19: with the stepping done at the training thread's hooks the
disk sat idle about a sixth of the 4B backward). The training thread only queues (`submit`, an in-memory
gradient held as a view, no copy; `submit_stored`) and waits (`settle(m)` before master m's unit is
gathered, `finish()`); torch's kernels release the GIL, so the step's arithmetic runs beside the
backward's. When more than `max_pending` masters hold in-memory gradients not yet stepped, `submit`
blocks (the memory bound: `max_pending` + 1 gradients, and `sets` buffer sets). A deferred tile waits
until the training thread's next `poll()` (its next forward: the LR scheduler has stepped by then, and
nothing writes gradients until the next backward), since it is stepped with the hyperparameters
`hyper` swapped into the optimizer's param groups for the length of its step. An error in the worker
is raised on the training thread at its next call.

The numbers are those of the step at `engine.step()`: the same gradient values reach the same
elementwise optimizer with the same hyperparameters, tile by tile.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import torch

from .aio import aligned_empty, aligned_numel

__all__ = ["BackwardSteps"]


class _Entry:
    __slots__ = ("tile", "master", "grad", "store", "hyper", "set", "reads", "writes", "state")

    def __init__(self, tile: int, master: int, grad: torch.Tensor | None = None, store=None, hyper=None):
        self.tile, self.master, self.grad, self.store, self.hyper, self.set = tile, master, grad, store, hyper, None
        self.reads: list = []
        self.writes: list = []
        self.state = "queued"  # queued -> reading -> writing -> (retired)


class BackwardSteps:
    """Tiles of `opt` (a built `SwappedOptimizer` whose states are known) stepped as gradients arrive.

    write_param: as `SwappedOptimizer.step`'s (called on the worker thread: it must be safe beside the
    training thread's gathers, as `ParamSwapper` is). sets: buffer sets of (master + states + gradient)
    tile buffers (host bytes: sets x (2 + states) x max_tile x 4, allocated once). max_pending: masters
    whose in-memory gradients may be alive (not fully stepped) when `submit` returns. defer_fraction:
    share of the elements (the masters reduced first: the last layers) stepped in the next forward.
    Counters: `stepped` (tiles stepped from in-memory gradients, in backwards), `stepped_deferred` (tiles
    stepped from stored gradients). Raises RuntimeError before the optimizer's first step (its states are
    not known yet: that step runs at `engine.step()`), and re-raises (as RuntimeError, chained) an error
    of the worker thread at the training thread's next call.
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
        self.done: set[int] = set()  # indices (in opt.tiles) of the tiles stepped since `start_backward`
        self.stepped = self.stepped_deferred = 0
        # shared with the worker, under `_cv`: entries not yet given a set, tiles not stepped, progress
        self._cv = threading.Condition()
        self._incoming: deque[_Entry] = deque()
        self._unstepped: dict[int, int] = {}  # master -> its tiles queued and not yet stepped
        self._holding: dict[int, int] = {}  # master -> its tiles not yet stepped from an in-memory gradient
        self._busy = 0  # entries submitted and not retired
        self._released = True  # False: stored (deferred) entries wait for the next `poll()`
        self._error: BaseException | None = None
        self._stop = False
        # the worker's own: entries holding a buffer set, oldest first, and the free sets
        self._active: deque[_Entry] = deque()
        self._free = list(range(len(self.sets)))
        self._thread: threading.Thread | None = None

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

    @property
    def busy(self) -> bool:
        """Tiles are queued or in flight."""
        return self._busy > 0

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
        numel: unscaled, reduced, accumulated; not modified afterwards). Blocks while more than
        `max_pending` masters' gradients wait to be stepped."""
        entries = []
        for t in self.opt.tiles_of(m):
            tile = self.opt.tiles[t]
            entries.append(_Entry(t, m, grad=grad[tile.first_element:tile.first_element + tile.numel].view(tile.shape)))
        self._queue(entries)
        with self._cv:
            self._wait_for(lambda: len(self._holding) <= self.max_pending)

    # -- the next forward -------------------------------------------------------------------------
    def submit_stored(self, m: int, store, hyper: list[dict]) -> None:
        """Queue master m's tiles with its gradient in `store` (a `SwappedGrads`; its rows are read with
        the tile), stepped with the param-group values `hyper` (one dict per group, 'params' left out).
        They start at the next `poll()`, `settle` or `finish`."""
        with self._cv:
            self._released = False
        self._queue([_Entry(t, m, store=store, hyper=hyper) for t in self.opt.tiles_of(m)])

    def settle(self, m: int) -> None:
        """Block until every queued tile of master m is stepped (its values are final)."""
        with self._cv:
            self._released = True
            self._cv.notify_all()
            self._wait_for(lambda: not self._unstepped.get(m))

    # -- progress ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Called at every gradient hook and unit forward: lets deferred tiles start (the step that queued
        them is over) and raises an error of the worker. Never blocks on I/O."""
        if self._error is not None:
            self._raise()
        if not self._released:
            with self._cv:
                self._released = True
                self._cv.notify_all()

    def finish(self) -> set[int]:
        """Complete every queued tile; returns the indices of the tiles stepped since `start_backward`."""
        with self._cv:
            self._released = True
            self._cv.notify_all()
            self._wait_for(lambda: self._busy == 0)
        return self.done

    def close(self) -> None:
        """Finish, then stop the worker thread (idempotent; a later submit starts a new one)."""
        try:
            if self._error is None:
                self.finish()
        finally:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            if self._thread is not None:
                self._thread.join()
            self._thread, self._stop = None, False

    # -- the training thread's side ---------------------------------------------------------------
    def _queue(self, entries: list[_Entry]) -> None:
        if not entries:
            return
        with self._cv:
            if self._error is not None:
                self._raise()
            for e in entries:
                self._unstepped[e.master] = self._unstepped.get(e.master, 0) + 1
                if e.grad is not None:
                    self._holding[e.master] = self._holding.get(e.master, 0) + 1
            self._incoming.extend(entries)
            self._busy += len(entries)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="zerospeed-backward-steps", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _wait_for(self, predicate) -> None:
        """Wait (holding `_cv`) until predicate() holds; raise the worker's error if it fails."""
        while not predicate():
            if self._error is not None:
                self._raise()
            self._cv.wait()
        if self._error is not None:
            self._raise()

    def _raise(self):
        raise RuntimeError(f"the optimizer step overlapped with the backward (offload_optimizer.super_offload) "
                           f"failed: {self._error!r}") from self._error

    # -- the worker -------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            while self._advance():
                pass
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _advance(self) -> bool:
        """One blocking move of the pipeline, oldest tile first; False when told to stop."""
        with self._cv:
            while not self._active and not self._startable():
                if self._stop:
                    return False
                self._cv.wait()
            started = []
            while self._free and self._startable():
                e = self._incoming.popleft()
                e.set = self._free.pop(0)
                started.append(e)
        for e in started:
            self._start_read(e)
            self._active.append(e)
        self._retire(block=False)
        e = next((e for e in self._active if e.state == "reading"), None)
        if e is not None:
            self._step(e)
        elif self._active:
            self._retire(block=True)
        return True

    def _startable(self) -> bool:
        return bool(self._incoming) and (self._released or self._incoming[0].store is None)

    def _start_read(self, e: _Entry) -> None:
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
        e.reads, e.state = [], "writing"
        held, e.grad = e.grad is not None, None
        with self._cv:
            self.done.add(e.tile)
            if held:
                self.stepped += 1
                _drop(self._holding, e.master)
            else:
                self.stepped_deferred += 1
            _drop(self._unstepped, e.master)
            self._cv.notify_all()

    def _retire(self, *, block: bool) -> None:
        """Free the sets of written tiles at the front (blocking: at least the first)."""
        while self._active and self._active[0].state == "writing":
            e = self._active[0]
            if not block and not all(h.done() for h in e.writes):
                return
            for h in e.writes:
                h.wait()
            self._active.popleft()
            with self._cv:
                self._free.append(e.set)
                self._busy -= 1
                self._cv.notify_all()
            block = False


def _drop(counts: dict[int, int], m: int) -> None:
    counts[m] -= 1
    if not counts[m]:
        del counts[m]
