"""ZeRO-3 parameter state: the typed per-parameter wrapper and the flat storage of one gather unit.

ZeRO, Rajbhandari et al. 2020, §5.3 (P_os+g+p): each of the N data-parallel ranks keeps only 1/N of
every parameter. We group parameters into *gather units* (`stage3_units.py`); the parameters of a
unit are flattened, concatenated and padded to a multiple of N elements, and rank r keeps elements
[r*S, (r+1)*S) of that flat vector (S = padded / N) as a leaf fp32 tensor, `ShardedUnit.shard`,
which the optimizer updates. One `all_gather_single` per unit rebuilds the full flat vector; one
`reduce_scatter_single` per unit and backward reduces its gradient.

Storage (as in FSDP2's `FSDPParam`, whose per-parameter state we mirror; DeepSpeed instead patches
18 `ds_*` attributes onto each `nn.Parameter`, which we never do):

* each unit owns one persistent full buffer `full` ([padded] elements). While SHARDED its storage is
  resized to 0 bytes; gathering resizes it back and all-gathers into it. Views of it saved by
  autograd during forward therefore see the re-gathered values in backward without a copy. On the
  host the released memory goes to the strategy's `offload.hostmem.GatheredPool` (`pool`) and the next unit
  gathered takes it from there (fresh pages, zeroed by the kernel on first touch, cost more than the
  all-gather's copy), as do its per-step buffers (`pool.buffers`, `pool.buckets`: under offload the offload
  path's `recycled`); a fresh mapping is advised to use huge pages (`offload.hostmem.advise_huge_pages`).
* a parameter's `.data` is a view into `full` while the unit is GATHERED and a 0-element
  placeholder otherwise, so a stray use fails on the shape instead of reading freed memory.
  Tensors derived from a gathered parameter (`p.detach()`, views) are valid only while its unit is
  gathered: clone them to keep them.

Lifecycle (`ParamStatus`, asserted transitions): SHARDED -> GATHERING -> GATHERED -> SHARDED.
"""
from __future__ import annotations

import enum

import torch
from torch import nn

from ..comm.collectives import GroupCollectives
from ..comm.ops import CommHandle
from ..offload.grads import widen_into
from ..offload.aio import HOST
from ..offload.hostmem import GatheredPool, advise_huge_pages, host_empty
from .clipping import sum_of_squares
from .ds_markers import ZeroParamStatus, mark
from .partition import FlatPartition, plan_one_chunk


class ParamStatus(enum.Enum):
    """Where a unit's parameters are (DeepSpeed's ZeroParamStatus NOT_AVAILABLE / INFLIGHT / AVAILABLE)."""

    SHARDED = "sharded"      # only this rank's shard exists; parameters hold 0-element placeholders
    GATHERING = "gathering"  # all-gather into the full buffer in flight
    GATHERED = "gathered"    # full buffer valid; parameters' .data are views into it


_DS_STATUS = {ParamStatus.SHARDED: ZeroParamStatus.NOT_AVAILABLE, ParamStatus.GATHERING: ZeroParamStatus.INFLIGHT,
              ParamStatus.GATHERED: ZeroParamStatus.AVAILABLE}  # DeepSpeed's names, on the parameters (ds_markers)
_ALLOWED = {ParamStatus.SHARDED: ParamStatus.GATHERING, ParamStatus.GATHERING: ParamStatus.GATHERED,
            ParamStatus.GATHERED: ParamStatus.SHARDED}


def _row_pieces(offset: int, numel: int, row: int):
    """Split elements [offset, offset + numel) of a flat vector cut into rows of `row` elements:
    yields (row index, column, start within the range, length) per piece."""
    e, end = offset, offset + numel
    while e < end:
        r, col = divmod(e, row)
        n = min(row - col, end - e)
        yield r, col, e - offset, n
        e += n


def _buffer(pool: GatheredPool | None, numel: int, dtype: torch.dtype, device, bucket: bool = False) -> torch.Tensor:
    """An uninitialised [numel] tensor: on the host from the strategy's caches (`pool.buckets` for a reduce-scatter
    bucket, else `pool.buffers`), without a pool `host_empty` (the process's cache on the host, a plain
    allocation on an accelerator)."""
    if pool is not None and torch.device(device).type == HOST.type:
        return (pool.buckets if bucket else pool.buffers).empty(numel, dtype)
    return host_empty(numel, dtype, device)


def _widened(pool: GatheredPool | None, low: torch.Tensor, dtype: torch.dtype, post: float) -> torch.Tensor:
    """A reduced 2-byte gradient as the fp32 accumulator value: float(low) x (1 / post)."""
    return widen_into(_buffer(pool, low.numel(), dtype, low.device).view(low.shape), low, post)


def _recycled_copy(pool: GatheredPool | None, src: torch.Tensor, divide_by: float = 1.0) -> torch.Tensor:
    """A copy of `src` (divided by `divide_by`) in a recycled buffer (`_buffer`): a shard-sized tensor made
    afresh every step would otherwise be a new mapping whose pages the kernel zeroes on first touch."""
    out = _buffer(pool, src.numel(), src.dtype, src.device).view(src.shape)
    return torch.div(src, divide_by, out=out) if divide_by != 1.0 else out.copy_(src)


def _add_reduced(grad: torch.Tensor, reduced: torch.Tensor, post: float) -> None:
    """grad += reduced / post for a later micro-step: a 2-byte `reduced` is added with alpha 1/post,
    an fp32 one (scratch: divided in place) divided first - the roundings of both gradient paths."""
    if reduced.dtype != grad.dtype:
        grad.add_(reduced, alpha=1.0 / post)
        return
    if post != 1.0:
        reduced.div_(post)
    grad.add_(reduced)


def start_bucket_reduce(units: list[ShardedUnit], *, comms: GroupCollectives, predivide: float):
    """One reduce-scatter for the gradients of several units (a `reduce_bucket_size` bucket, as
    DeepSpeed's stage-3 ipg bucket). The bucket is rank-major, [world, sum of shard_numel]: row r
    holds rank r's part of every unit, so this rank receives its shards of all units in one row.
    Returns (handle, [(unit, its reduced slice [shard_numel]), ...]); the units' full gradients are
    dropped. Units must share reduce_dtype and device (one policy per strategy)."""
    u0, world, rank = units[0], units[0].world, units[0].rank
    cols = [u.layout.shard_numel for u in units]
    extra = comms.reduce_scatter_workspace_numel(sum(cols))  # the receive buffer, in the same recycled block
    block = _buffer(u0.pool, world * sum(cols) + extra, u0.reduce_dtype, u0.full.device, bucket=True)
    bucket = block[:world * sum(cols)].view(world, sum(cols))
    pieces, c = [], 0
    for u, k in zip(units, cols):
        u.take_grads(bucket[:, c:c + k])
        pieces.append((u, bucket[rank, c:c + k]))
        c += k
    if predivide != 1.0:
        bucket.div_(predivide)
    # in place: the bucket is scratch (on gloo: point-to-point messages + local sum, no clone)
    handle = comms.start_reduce_scatter(bucket[rank], bucket.view(-1), input_is_scratch=True,
                                        workspace=block[world * sum(cols):] if extra else None)
    return handle, pieces


class ShardedParam:
    """Per-parameter ZeRO-3 state, kept beside (never on) the `nn.Parameter` (which carries only DeepSpeed's
    read-only markers `ds_id` / `ds_status` / `ds_numel` / `ds_shape` for user scripts: `ds_markers`).

    param: the parameter object the module holds. fqn: its canonical name from
    `model.named_parameters()`; aliases: every name it has (tied weights have several).
    shape / numel: the full shape and element count. index: position in its unit; the unit's
    `layout` gives its offset. `status` is the unit's (one all-gather serves the whole unit).
    """

    def __init__(self, param: nn.Parameter, fqn: str, aliases: tuple[str, ...], unit: ShardedUnit, index: int,
                 shape: torch.Size):
        self.param = param
        self.fqn = fqn
        self.aliases = aliases
        self.shape = shape
        self.numel = shape.numel()
        self.unit = unit
        self.index = index
        self.view: torch.Tensor | None = None  # [shape] view into unit.full, valid while GATHERED

    @property
    def status(self) -> ParamStatus:
        return self.unit.status

    @property
    def offset(self) -> int:
        return self.unit.layout.starts[self.index]

    def local_shard(self) -> torch.Tensor:
        """This rank's part of the parameter, flattened: a 1-D view into `unit.shard` (the fp32 master
        under mixed precision; maybe 0 elements)."""
        lo, hi = self.unit.layout.param_shard_range(self.index, self.unit.rank)
        start = self.unit.layout.rank_range(self.unit.rank)[0]
        base = self.offset + lo - start
        return self.unit.shard.detach()[base:base + hi - lo]

    def __repr__(self) -> str:
        return f"ShardedParam({self.fqn}, shape={tuple(self.shape)}, {self.status.value})"


class ShardedUnit:
    """The flat storage of one gather unit on one rank (ZeRO, Rajbhandari et al. 2020, §5.3).

    name: the unit's module name ("" for the root unit). params: (parameter, fqn, aliases) in flat
    order; their current `.data` must hold the full values (rank 0's after `initialize`'s broadcast).
    shard: nn.Parameter [shard_numel] fp32, this rank's slice: the *master* the optimizer updates;
    `shard.grad` (fp32) is the reduced, averaged gradient slice, accumulated over micro-steps; None
    until the step's first reduction and again after `zero_grad` (as torch's set_to_none).
    lp_shard: the same slice in the parameter dtype, the all-gather source: `shard.detach()` itself
    in fp32 training; under bf16/fp16 a separate tensor refreshed from `shard` after each step
    (`sync_after_step`). full: [padded] buffer in the parameter dtype, 0 bytes while SHARDED.
    Without a separate master (fp32, no offload) the shard lives *inside* `full` while the unit is
    gathered (`shard.data` is this rank's slice of it; a copy is taken out again at `release`), so a
    gathered unit costs its full size, not full + shard: 4Ψ/N bytes less while everything is gathered.
    master_dtype: the shard's dtype (default: the parameters'; fp32 under mixed precision).
    reduce_dtype: dtype of the gradient reduce-scatter (default: the parameters').
    pins: holders (GatheredParameters, external parameters, generation) that keep it gathered.
    shape_of / full_value: a parameter's full shape and full value (default `p.shape`, `p.data`;
    `zerospeed.zero.Init` passes its own for parameters it partitioned: the values are then
    all-gathered one parameter at a time, so only this unit is ever full). Under mixed precision
    full_value must return the original fp32 values: the master shard is cut from them before the
    parameter-dtype copy is rounded.
    """

    def __init__(self, index: int, name: str, params: list[tuple[nn.Parameter, str, tuple[str, ...]]], *,
                 rank: int, world: int, shape_of=None, full_value=None, master_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, master_device: torch.device | None = None,
                 param_device: torch.device | None = None, param_swapper=None,
                 gathered_pool: GatheredPool | None = None):
        self.index, self.name, self.rank, self.world = index, name, rank, world
        self.pool = gathered_pool
        shape_of = shape_of or (lambda p: p.shape)
        full_value = full_value or (lambda p: p.data)
        self.params = [ShardedParam(p, fqn, aliases, self, i, shape_of(p))
                       for i, (p, fqn, aliases) in enumerate(params)]
        self.layout: FlatPartition = plan_one_chunk([sp.numel for sp in self.params], world)
        ref = params[0][0] if params else torch.empty(0)
        if any(p.dtype != ref.dtype or p.device != ref.device for p, _, _ in params):
            raise TypeError(f"gather unit {name or '<root>'}: all parameters must share one dtype and device")
        self.full = torch.zeros(self.layout.padded_numel, dtype=ref.dtype, device=ref.device)
        self.placeholder = torch.empty(0, dtype=ref.dtype, device=ref.device)
        self.master_dtype = master_dtype or ref.dtype
        self.reduce_dtype = reduce_dtype or ref.dtype
        start, end = self.layout.rank_range(rank)
        master = torch.zeros(self.layout.shard_numel, dtype=self.master_dtype, device=master_device or ref.device)
        with torch.no_grad():
            for sp in self.params:
                value = full_value(sp.param)
                sp.view = self.full[sp.offset:sp.offset + sp.numel].view(sp.shape)
                sp.view.copy_(value)
                lo, hi = self.layout.param_shard_range(sp.index, rank)
                if hi > lo:  # cut the master from the value itself, not from its rounded copy
                    master[sp.offset + lo - start:sp.offset + hi - start].copy_(value.reshape(-1)[lo:hi])
            self.shard = nn.Parameter(master)
            # a separate low-precision shard: mixed precision, or any offload (the master leaves it)
            self.has_master = self.master_dtype != ref.dtype or master_device is not None or \
                param_device is not None or param_swapper is not None
            self.lp_shard = self.full[start:end].to(param_device or ref.device, copy=True) if self.has_master \
                else self.shard.detach()
        self.swapper = param_swapper if param_swapper is not None and self.layout.padded_numel else None
        self.alias = not self.has_master and self.swapper is None and self.layout.padded_numel > 0
        self.aliased = False  # shard.data is this rank's slice of `full` (GATHERED, `alias` only)
        if self.swapper is not None:  # NVMe: the shard lives in a swap file (unless max_in_cpu keeps it)
            kept = self.swapper.add(index, self.lp_shard)
            self.lp_shard = kept if kept is not None else self.placeholder
        self.master_store = None  # a SwappedOptimizer holding the master (NVMe), set by the strategy
        self.master_index = -1  # the master's index in master_store (and grad_store)
        self.grad_store = None  # a SwappedGrads holding the fp32 gradient (NVMe), set by the strategy
        self.settle = None  # callable(unit) run before the shard is read: a deferred optimizer step finishes first
        self.lp_grad: torch.Tensor | None = None  # a reduced bf16/fp16 gradient not yet in shard.grad
        self._lp_grad_post = 1.0
        self.status = ParamStatus.GATHERED
        for sp in self.params:
            mark(sp.param, sp.shape, ZeroParamStatus.AVAILABLE)
        self._part_lengths: list[int] | None = None  # each parameter's elements in this rank's shard
        self._mark_partitions()
        self.pins = 0
        self.handle: CommHandle | None = None
        self.release()

    # -- lifecycle ----------------------------------------------------------------------------
    def _to(self, new: ParamStatus) -> None:
        if _ALLOWED[self.status] is not new:
            raise RuntimeError(f"ZeRO-3 unit {self.name or '<root>'}: illegal transition {self.status.value} -> "
                               f"{new.value} (allowed: {self.status.value} -> {_ALLOWED[self.status].value})")
        self.status = new
        for sp in self.params:
            sp.param.ds_status = _DS_STATUS[new]

    def start_gather(self, comms: GroupCollectives) -> None:
        """SHARDED -> GATHERING: allocate the full buffer and start its all-gather (`comms`, over the
        group of `world` ranks this unit is sharded over)."""
        self._to(ParamStatus.GATHERING)
        storage, nbytes = self.full.untyped_storage(), self.layout.padded_numel * self.full.element_size()
        if self.pool is not None and self.full.device.type == HOST.type:
            fresh = self.pool.acquire(storage, nbytes)
        else:
            storage.resize_(nbytes)
            fresh = True
        if fresh and self.full.device.type == HOST.type:
            advise_huge_pages(self.full)  # a fresh mapping, filled next: fewer page faults
        if self.layout.padded_numel:
            self.handle = comms.start_all_gather(self.full, self._lp_source())

    def finish_gather(self) -> None:
        """GATHERING -> GATHERED: wait for the all-gather and point every parameter at its view."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            if self.swapper is not None:
                self.swapper.release(self.index)
        self._to(ParamStatus.GATHERED)
        for sp in self.params:
            sp.param.data = sp.view
        if self.alias and not self.pins:  # the shard's own storage is freed: its values are this rank's slice of full
            self._bind_shard(self.full[slice(*self.layout.rank_range(self.rank))])
            self.aliased = True

    def release(self) -> None:
        """GATHERED -> SHARDED: parameters get 0-element placeholders; the full buffer's storage is freed
        (an aliased shard is first copied out of it)."""
        self._to(ParamStatus.SHARDED)
        for sp in self.params:
            sp.param.data = self.placeholder
        self.own_shard_storage()
        if self.pool is not None and self.full.device.type == HOST.type:
            self.pool.release(self.full.untyped_storage())  # the memory is handed to the next unit gathered
        else:
            self.full.untyped_storage().resize_(0)

    def own_shard_storage(self) -> None:
        """Give an aliased shard its own storage again (a copy of its slice of `full`), so edits of the
        gathered values stay out of it until `write_back` (GatheredParameters without modifier_rank)."""
        if self.aliased:
            self._bind_shard(_recycled_copy(self.pool, self.shard.detach()))
            self.aliased = False

    def _bind_shard(self, values: torch.Tensor) -> None:
        """Point the master `shard` (same Parameter object: the optimizer's key) and `lp_shard` at `values`."""
        self.shard.data = values
        self.lp_shard = self.shard.detach()
        self._mark_partitions()

    def _mark_partitions(self) -> None:
        """Each parameter's `ds_tensor` (DeepSpeed's marker): its part of `lp_shard`, a 1-D view (maybe empty).
        The parts tile the front of this rank's shard in parameter order (`plan_one_chunk` lays the parameters
        out back to back), so one `split` cuts them: ~10 us for a 12-parameter unit, at each rebinding."""
        if self._part_lengths is None:
            self._part_lengths = [max(hi - lo, 0) for lo, hi in
                                  (self.layout.param_shard_range(sp.index, self.rank) for sp in self.params)]
        held = sum(self._part_lengths)
        parts = self.lp_shard[:held].split(self._part_lengths) if self.lp_shard.numel() >= held else \
            [self.lp_shard[:0]] * len(self.params)  # the shard is on NVMe: nothing resident
        for sp, part in zip(self.params, parts):
            sp.param.ds_tensor = part

    # -- gradients ----------------------------------------------------------------------------
    def take_grads(self, dst: torch.Tensor) -> None:
        """Move the full gradients (None counts as zeros; padding is zeroed) into `dst` and drop them
        from the parameters. dst: [world, shard_numel] in `reduce_dtype`, row r = rank r's part of the
        flat gradient (a column block of a bucket: `start_bucket_reduce`)."""
        s = self.layout.shard_numel
        for sp in self.params:
            g = sp.param.grad
            src = g.reshape(-1) if g is not None else None
            for r, col, lo, n in _row_pieces(sp.offset, sp.numel, s):
                if src is None:
                    dst[r, col:col + n].zero_()
                else:
                    dst[r, col:col + n].copy_(src[lo:lo + n])
            sp.param.grad = None
        for r, col, _, n in _row_pieces(self.layout.numel, self.layout.padding, s):
            dst[r, col:col + n].zero_()

    def accumulate(self, reduced: torch.Tensor, post: float) -> None:
        """shard.grad += reduced / post (post = world size for averaging; a None `shard.grad` is created
        here, so between steps it holds no memory). `reduced` is not kept (it may be a view into a
        bucket). A bf16/fp16 `reduced` of the first micro-step is kept as it is (`lp_grad`, 2 bytes per
        element: the paper's 2Ψ/N gradient partition) until `materialize_grad` turns it into the fp32
        `shard.grad` at the step; a second micro-step does that first and adds into the fp32
        accumulator, divided in fp32 (the same roundings either way)."""
        if self.grad_store is not None:
            self._accumulate_swapped(reduced, post)
            return
        owned = reduced.device != self.shard.device
        if owned:  # optimizer offload: the gradient goes down to the host
            reduced = reduced.to(self.shard.device, non_blocking=True)
        if self.shard.grad is None and self.lp_grad is None and reduced.dtype != self.master_dtype:
            self.lp_grad, self._lp_grad_post = (reduced if owned else _recycled_copy(self.pool, reduced)), post
            return
        self.materialize_grad()
        grad = self.shard.grad
        if grad is None:  # the same roundings as adding into zeros below
            self.shard.grad = reduced if owned and post == 1.0 else _recycled_copy(self.pool, reduced, post)
        else:
            _add_reduced(grad, reduced, post)

    def _accumulate_swapped(self, reduced: torch.Tensor, post: float) -> None:
        """`accumulate` with the gradient on NVMe (`grad_store`, a `SwappedGrads`): the first micro-step
        writes a 2-byte `reduced` as it is (with `post`: the store converts it as `materialize_grad`
        does when it is read) or an fp32 one divided by post; a later one reads it back in fp32, adds
        (the in-memory path's operations) and writes fp32. Each write carries its sum of squares."""
        m, n, store = self.master_index, self.layout.shard_numel, self.grad_store
        grad = store.read(m, n)
        consume = store.consumer is not None and store.consumer.takes(m) and self.status is ParamStatus.SHARDED \
            and not self.pins
        if grad is None and reduced.dtype != self.master_dtype and consume:  # its fp32 value, straight to the step
            grad = widen_into(store.buffer(n), reduced, post)
            store.consume(m, grad, sum_of_squares([grad]))
            return
        if grad is None and reduced.dtype != self.master_dtype:  # kept in 2 bytes, as `lp_grad` in memory
            low = store.buffer(n, reduced.dtype)
            low.copy_(reduced)
            store.write(m, low, sum_of_squares([_widened(self.pool, low, self.master_dtype, post)]), post=post)
            return
        if grad is None:
            grad = store.buffer(n)
            if post != 1.0:
                torch.div(reduced.to(grad.device), post, out=grad)
            else:
                grad.copy_(reduced)
        else:  # the bucket's slice (scratch) or a host copy
            _add_reduced(grad, reduced.to(grad.device), post)
        if consume:  # super_offload: the optimizer steps this master now, in the backward
            store.consume(m, grad, sum_of_squares([grad]))
        else:
            store.write(m, grad, sum_of_squares([grad]))

    def materialize_grad(self) -> None:
        """Turn a kept low-precision gradient (`lp_grad`) into the fp32 `shard.grad` (times 1/post)."""
        if self.lp_grad is not None:
            self.shard.grad = _widened(self.pool, self.lp_grad, self.master_dtype, self._lp_grad_post)
            self.lp_grad = None

    # -- whole-unit helpers -------------------------------------------------------------------
    def sync_rebound(self) -> None:
        """If a user re-bound `p.data` (instead of editing in place), copy it into the full buffer."""
        if self.status is not ParamStatus.GATHERED:
            raise RuntimeError(f"unit {self.name or '<root>'} is {self.status.value}, not gathered")
        with torch.no_grad():
            for sp in self.params:
                if sp.param.data.data_ptr() != sp.view.data_ptr() and sp.param.shape == sp.shape:
                    sp.view.copy_(sp.param.data)
                    sp.param.data = sp.view

    def write_back(self) -> None:
        """Copy this rank's slice of the (gathered, possibly edited) full buffer into the shard (and,
        under mixed precision, into the fp32 master too: the edit is made in the parameter dtype)."""
        self.sync_rebound()
        start, end = self.layout.rank_range(self.rank)
        with torch.no_grad():
            mine = self.full[start:end]
            self.set_lp(mine)
            if self.master_store is not None:
                self.master_store.write_master(self.master_index, mine.to(self.master_dtype))
            elif self.has_master:
                self.shard.detach().copy_(mine)

    def _lp_source(self) -> torch.Tensor:
        """This rank's shard in the parameter dtype on the compute device, to all-gather from (read from
        NVMe, or copied up from the host, when offloaded; NVMe: the buffer is freed by finish_gather)."""
        if self.settle is not None:
            self.settle(self)
        src = self.swapper.acquire(self.index) if self.swapper is not None else self.lp_shard
        return src.to(self.full.device, non_blocking=True) if src.device != self.full.device else src

    def set_lp(self, values: torch.Tensor) -> None:
        """New values (any dtype/device, [shard_numel]) for the parameter-dtype shard (NVMe: written out)."""
        if self.swapper is not None:
            self.swapper.store(self.index, values.to(self.full.dtype))
        elif self.lp_shard.data_ptr() != values.data_ptr():
            self.lp_shard.copy_(values)

    def sync_after_step(self) -> None:
        """After the optimizer updated the master `shard`: round it into `lp_shard` (mixed precision,
        offload). A master on NVMe (`master_store`) is written to the shard by the swapped step itself."""
        if self.has_master and self.master_store is None:
            with torch.no_grad():
                self.set_lp(self.shard.detach())

    def after_step(self, comms: GroupCollectives) -> None:
        """After the masters changed (step, checkpoint load): refresh the shard; a unit still gathered is
        re-gathered if pinned (GatheredParameters, generation) and released otherwise."""
        self.sync_after_step()
        if self.status is ParamStatus.GATHERING:
            self.finish_gather()
        if self.status is ParamStatus.GATHERED and self.pins:
            comms.start_all_gather(self.full, self._lp_source()).wait()
            if self.swapper is not None:
                self.swapper.release(self.index)
        elif self.status is ParamStatus.GATHERED:
            self.release()

    @property
    def requires_grad(self) -> bool:
        return bool(self.params)

    def gathered_bytes(self) -> int:
        """Bytes the full buffer holds right now (0 while SHARDED)."""
        return self.full.untyped_storage().nbytes()

    def shard_bytes(self) -> int:
        """Bytes of the parameter-dtype shard outside `full` (0 while it lives inside it)."""
        return 0 if self.aliased else self.lp_shard.numel() * self.lp_shard.element_size()

    def __repr__(self) -> str:
        return (f"ShardedUnit({self.name or '<root>'}, {len(self.params)} params, {self.layout.numel} elements, "
                f"shard {self.layout.shard_numel}, {self.status.value})")
