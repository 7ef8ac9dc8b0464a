"""The parameters `zerospeed.zero.Init` partitions: a weak registry and each parameter's lifecycle.

Internal to `stage3_init.py` (the user-facing `Init`); `stage3.py` and `stage3_context.py` reach it
through the names `stage3_init` re-exports. One `InitShard` per parameter, keyed by `id` (weakly: no
attribute is patched onto the `nn.Parameter`, DESIGN rule 3), in one of three states:

    TOUCHED  .data is the full tensor: just registered, or in use by an op inside `Init`
    SHARDED  .data is an empty [0] tensor; `local` is this rank's slice [ceil(numel / N)] of the
             flattened parameter, zero-padded at the end (rank r holds elements [r*k, (r+1)*k))
    GATHERED .data is full inside `zerospeed.zero.GatheredParameters`

    register -> TOUCHED -settle-> SHARDED -touch-> TOUCHED;  SHARDED -gather-> GATHERED -release-> SHARDED

`settle` cuts rank 0's full value into slices and scatters them (one collective per parameter, so all
ranks agree even if their random draws differed); `touch` all-gathers the slices, or allocates an
uninitialised full tensor when the op about to run overwrites every element (`normal_`, `zero_`,
`copy_`, any `torch.nn.init` function), so initialising a partitioned parameter costs no gather.
Every transition that moves data is a collective: run the same code on every rank. Building a
transformers model costs one scatter per parameter at registration and one per re-initialisation
in `post_init` (GPT-2, 28 parameters: 57 scatters, no all-gather).
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from ..comm.ops import start_all_gather
from .ds_markers import ZeroParamStatus, mark


class ShardState(enum.Enum):
    TOUCHED = "touched"
    SHARDED = "sharded"
    GATHERED = "gathered"


_TRANSITIONS = {(ShardState.TOUCHED, ShardState.SHARDED), (ShardState.SHARDED, ShardState.TOUCHED),
                (ShardState.SHARDED, ShardState.GATHERED), (ShardState.GATHERED, ShardState.SHARDED)}


@dataclass
class InitShard:
    """One parameter partitioned by Init. shape / numel: the full parameter's; local: this rank's
    zero-padded slice [ceil(numel / N)] (None while TOUCHED, or while it is on NVMe); owner: the module
    it was registered on; spill: the `InitSpill` its slice is written to (remote_device="nvme"), whose
    key `spilled` names it while it is there; dtype / device: the slice's."""

    shape: torch.Size
    numel: int
    group: dist.ProcessGroup | None
    owner: weakref.ref | None = None
    local: torch.Tensor | None = None
    state: ShardState = ShardState.TOUCHED
    spill: object = None
    spilled: str | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None

    @property
    def gathered(self) -> bool:
        return self.state is ShardState.GATHERED

    def to(self, new: ShardState) -> None:
        if (self.state, new) not in _TRANSITIONS:
            raise RuntimeError(f"zerospeed.zero.Init: internal error, shard state {self.state.name} -> {new.name}")
        self.state = new


_SHARDS: dict[int, tuple[weakref.ref, InitShard]] = {}  # id(param) -> (weak reference, shard)
_SPILL_IDS = iter(range(1 << 62))  # keys of spilled slices (an id() may be reused after a parameter dies)
_TOUCHED: dict[int, nn.Parameter] = {}  # TOUCHED parameters (full on every rank), in touch order
_INTERNAL = [0]  # > 0 while our own code touches parameters (the Init guard lets it through)


class internal:
    """`with internal():` our own tensor code on partitioned parameters (the Init guard ignores it)."""

    def __enter__(self):
        _INTERNAL[0] += 1

    def __exit__(self, *exc):
        _INTERNAL[0] -= 1


def init_shard(param: torch.Tensor) -> InitShard | None:
    """The Init shard of `param`, or None if Init did not partition it (or handed it over)."""
    entry = _SHARDS.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def shape_of(param: torch.Tensor) -> torch.Size:
    """The full shape of `param`, partitioned by Init or not."""
    st = init_shard(param)
    return st.shape if st is not None else param.shape


def partitioned_parameters(module: nn.Module) -> list[str]:
    """Names of `module`'s parameters partitioned by Init and not yet handed to a stage-3 strategy."""
    return [n for n, p in module.named_parameters() if init_shard(p) is not None]


def eligible(param) -> bool:
    """Init partitions a parameter with elements, not on the meta device, not already partitioned."""
    with internal():
        return isinstance(param, nn.Parameter) and init_shard(param) is None and not param.is_meta \
            and param.numel() > 0


def register(param: nn.Parameter, group, owner: nn.Module | None, spill=None) -> InitShard:
    """Start partitioning `param` (its full value stays until the next `settle`). Local, no collective.
    spill: an `InitSpill` to keep its slice in (NVMe) instead of memory."""
    st = InitShard(param.shape, param.numel(), group, weakref.ref(owner) if owner is not None else None,
                   spill=spill)
    key = id(param)
    _SHARDS[key] = (weakref.ref(param), st)
    weakref.finalize(param, _forget, key)
    _TOUCHED[key] = param
    return st


def _forget(key: int) -> None:
    entry = _SHARDS.pop(key, None)
    if entry is not None:
        _discard(entry[1])


def _store(st: InitShard, local: torch.Tensor) -> None:
    """Keep `local` as the shard's slice: in memory, or written to its spill."""
    st.dtype, st.device = local.dtype, local.device
    if st.spill is None:
        st.local = local
        return
    st.spilled = f"init_{next(_SPILL_IDS)}"
    st.spill.put(st.spilled, local)
    st.local = None


def _load(st: InitShard) -> torch.Tensor:
    """The shard's slice (read back from its spill if it is there)."""
    if st.spilled is None:
        return st.local
    return st.spill.get(st.spilled).to(st.device)


def _discard(st: InitShard) -> None:
    """Forget the shard's slice (delete its spilled file)."""
    st.local = None
    if st.spilled is not None:
        st.spill.drop(st.spilled)
        st.spilled = None


def _cut(value: torch.Tensor, group, src: int) -> torch.Tensor:
    """This rank's zero-padded slice of group rank `src`'s `value` (scattered; `value` is only read)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = value.numel()
    per = -(-n // world)
    local = torch.zeros(per, dtype=value.dtype, device=value.device)
    chunks = None
    if rank == src:
        flat = value.detach().reshape(-1)
        chunks = []
        for r in range(world):
            piece = flat[min(r * per, n):min((r + 1) * per, n)]
            if piece.numel() < per:
                piece = torch.cat([piece, piece.new_zeros(per - piece.numel())])
            chunks.append(piece.contiguous())
    with record_function("zerospeed::scatter"):
        dist.scatter(local, chunks, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return local


def _full(st: InitShard) -> torch.Tensor:
    world = dist.get_world_size(st.group)
    local = _load(st)
    out = torch.empty(local.numel() * world, dtype=local.dtype, device=local.device)
    start_all_gather(out, local, group=st.group).wait()
    return out[:st.numel].view(st.shape)


def _partition(st: InitShard) -> torch.Tensor:
    """This rank's slice for DeepSpeed's `ds_tensor` marker (0 elements while it is on NVMe)."""
    return st.local if st.local is not None else torch.empty(0, dtype=st.dtype, device=st.device)


def _empty_like_param(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=param.dtype, device=param.device)


def settle(keep_owners: tuple = ()) -> None:
    """TOUCHED -> SHARDED for every touched parameter not owned by one of `keep_owners` (in touch
    order). Collective per parameter (a scatter from group rank 0)."""
    if not _TOUCHED:
        return
    keep = {id(m) for m in keep_owners}
    with internal(), torch.no_grad():
        for key, param in list(_TOUCHED.items()):
            st = init_shard(param)
            if st is None or st.state is not ShardState.TOUCHED:
                del _TOUCHED[key]
                continue
            owner = st.owner() if st.owner is not None else None
            if owner is not None and id(owner) in keep:
                continue
            value = param.data  # the op may have replaced it (`p.data = x`): take its shape from the value
            st.shape, st.numel = value.shape, value.numel()
            _store(st, _cut(value, st.group, 0))
            st.to(ShardState.SHARDED)
            param.data = _empty_like_param(value)
            mark(param, st.shape, ZeroParamStatus.NOT_AVAILABLE, _partition(st))
            del _TOUCHED[key]


def drop_touched() -> None:
    """Forget the touched set without a collective (a failing rank): those parameters stay full and
    Init forgets them."""
    for key, param in list(_TOUCHED.items()):
        if init_shard(param) is not None:
            _SHARDS.pop(key, None)
    _TOUCHED.clear()


def touch(param: nn.Parameter, overwrite: bool) -> None:
    """SHARDED -> TOUCHED: give `param` its full value (all-gather; or, with `overwrite`, a fresh
    uninitialised tensor the caller's op fills). Collective unless `overwrite`."""
    st = init_shard(param)
    with internal(), torch.no_grad():
        if overwrite:
            param.data = torch.empty(st.shape, dtype=st.dtype, device=st.device)
        else:
            param.data = _full(st)
    _discard(st)
    st.to(ShardState.TOUCHED)
    param.ds_status = ZeroParamStatus.AVAILABLE
    _TOUCHED[id(param)] = param


def replaced(param: nn.Parameter) -> None:
    """`param.data` was assigned a full value while SHARDED: it is TOUCHED now. Local, no collective."""
    st = init_shard(param)
    if st is not None and st.state is ShardState.SHARDED:
        _discard(st)
        st.to(ShardState.TOUCHED)
        param.ds_status = ZeroParamStatus.AVAILABLE
        _TOUCHED[id(param)] = param


def full_value(param: torch.Tensor) -> torch.Tensor:
    """The full value of `param`: its data, or (collective) the all-gather of its Init slices, after
    which Init forgets it (a stage-3 strategy owns it from then on)."""
    if init_shard(param) is None:
        return param.data
    settle()
    entry = _SHARDS.pop(id(param))
    st = entry[1]
    value = param.data if st.state is ShardState.GATHERED else _full(st)
    _discard(st)
    return value


def gather(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """GatheredParameters for Init-partitioned parameters: give each its full value. Collective.
    Returns the parameters gathered here (to hand to `release`)."""
    if not any(init_shard(p) is not None for p in params):
        return []
    settle()
    taken = []
    with internal():
        for p in params:
            st = init_shard(p)
            if st is not None and st.state is ShardState.SHARDED and not any(q is p for q in taken):
                p.data = _full(st).clone()
                st.to(ShardState.GATHERED)
                p.ds_status = ZeroParamStatus.AVAILABLE
                taken.append(p)
    return taken


def release(params: list[nn.Parameter], modifier_rank: int | None) -> None:
    """Undo `gather`; with modifier_rank, that group rank's values are scattered as the new slices
    (edits made there take effect everywhere). Collective when modifier_rank is not None."""
    with internal(), torch.no_grad():
        for p in params:
            st = init_shard(p)
            if st is None or st.state is not ShardState.GATHERED:
                continue
            if modifier_rank is not None:
                value = p.data
                st.shape, st.numel = value.shape, value.numel()
                _discard(st)
                _store(st, _cut(value, st.group, modifier_rank))
            st.to(ShardState.SHARDED)
            p.data = _empty_like_param(p.data)
            mark(p, st.shape, ZeroParamStatus.NOT_AVAILABLE, _partition(st))
