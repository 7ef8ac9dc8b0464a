"""DeepSpeed's `deepspeed.utils` parameter accessors: full fp32 values, gradients and optimizer states of
one model parameter, whatever ZeRO stage holds it (`safe_get_full_fp32_param`, `safe_get_full_grad`,
`safe_get_full_optimizer_state`, `safe_set_full_fp32_param`, `safe_set_full_optimizer_state`, and the
`safe_get_local_*` variants).

Semantics (DeepSpeed's `deepspeed/utils/tensor_fragment.py`): call the `safe_get_full_*` / `safe_set_*`
functions on every data-parallel rank, in the same order. At every stage (0 included, so the same code
runs everywhere) a `safe_get_full_*` call is one all-reduce over the strategy's data-parallel group:
each rank writes the fragments of the parameter it owns (`zero/fragments.py`: over all ranks they cover
every element once) into a zero [numel + 1] fp32 buffer whose last element flags "this rank owns some
of it and has the field", and the sum is the full value on every rank, in the parameter's full shape (at stage 3 the
model parameter may be a 0-element placeholder; the shape is the logical one). Results are fresh
tensors: writing into them changes nothing.

None (on every rank) where DeepSpeed returns None: the parameter is not managed by a live zerospeed
strategy (frozen, another model, no engine); `safe_get_full_grad` outside [`engine.backward()` at an accumulation boundary (or stage 2's every
micro-step), `engine.step()`); `safe_get_full_optimizer_state` for a state the optimizer does not keep (before the first
step, or a key it never has).

Gradients are the reduced (averaged over data-parallel ranks) gradients the next step will apply,
read between `engine.backward()` and `engine.step()` at a gradient-accumulation boundary. They are
fp32 under bf16 (the masters' gradients). Under fp16 with loss scaling they are still multiplied by
the loss scale (the engine unscales inside `step()`); divide by `engine.loss_scale` if needed.

`safe_set_full_fp32_param(param, value)` writes the fp32 master (this rank's fragments, taken from the
full `value` every rank passes) and then refreshes the compute parameters from the masters
(`strategy.refresh_params_from_master()`, collective at stages >= 1), so the next forward uses the
new value on every rank. `safe_set_full_optimizer_state` writes this rank's fragments of a state the
optimizer already has (local; KeyError before the first step). NVMe-offloaded optimizer states are
not reachable (NotImplementedError, as for checkpoints).

Lookup: every strategy registers itself in `zero.stage3_context`'s registry of live strategies (weak
references). A parameter maps to the live stage-3 strategy that manages it (`strategy.managed(param)`),
else to the most recently built stage 0-2 one holding it in `strategy.params`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
           "safe_get_local_grad", "safe_get_local_optimizer_state"]

MASTER, GRAD = "master", "grad"  # fields besides optimizer-state names

Piece = tuple[int, int, torch.Tensor]  # (start, end, 1-D tensor of end - start elements) of the flattened param


def _locate(param: torch.Tensor):
    """(strategy, index key, full shape) for `param`, or (None, None, None)."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"expected a model parameter (torch.Tensor), got {type(param).__name__}")
    from ..zero import stage3_context as ctx

    s, sp = ctx._find(param)  # the live stage-3 strategies (they register there)
    if s is not None:
        return s, sp, tuple(sp.shape)
    for s in reversed(ctx.live_strategies()):
        if s.stage != 3:
            for i, p in enumerate(s.params):
                if p is param:
                    return s, i, tuple(p.shape)
    return None, None, None


def _rank_world(strategy) -> tuple[int, int]:
    group = getattr(strategy, "group", None)
    return dist.get_rank(group), dist.get_world_size(group)


# -- what this rank owns of one parameter ------------------------------------------------------------
def _value_slots(strategy, key, *, write: bool = False):
    """[(local tensor the optimizer updates, [(start, end, take)])] for the parameter `key`: the
    fragments machinery (`zero/fragments.py`) restricted to one parameter. write: at stage 0 every rank
    holds (and must write) the whole replicated value, as a checkpoint load does."""
    from ..zero import fragments as fr

    rank, world = _rank_world(strategy)
    if strategy.stage == 3:
        params = [sp.param for u in strategy.units for sp in u.params]
        target = key.param
    else:
        params, target = list(strategy.params), strategy.params[key]
    names = {id(p): (str(i), ()) for i, p in enumerate(params)}
    want = names[id(target)][0]
    if strategy.stage == 0:
        slots = fr._stage0_slots(strategy, names, rank, world, load=write)
    elif strategy.stage in (1, 2):
        slots = fr._stage12_slots(strategy, names, rank, world, load=False)
    else:
        slots = fr._stage3_slots(strategy, names, rank, world, load=False)  # binds the segment placeholders
    out = []
    for slot in slots:
        mine = [(start, end, take) for lp, start, end, take in slot.frags if lp.name == want]
        if mine:
            out.append((slot.local, mine))
    return out


def _check_reachable(strategy) -> None:
    if getattr(strategy, "swapped", None) is not None:
        raise NotImplementedError("safe_get/set_* cannot reach masters or optimizer states offloaded to NVMe "
                                  "(zero_optimization.offload_optimizer.device=nvme); use device \"cpu\" or none")


def _value_pieces(strategy, key, field: str, *, write: bool = False) -> list[Piece] | None:
    """This rank's pieces of the master (field "master") or of optimizer state `field`; None if this
    rank holds fragments but not that state."""
    _check_reachable(strategy)
    from ..zero import fragments as fr

    pieces, missing = [], False
    try:
        for local, frags in _value_slots(strategy, key, write=write):
            if field == MASTER:
                src = local.detach()
            else:
                elem, _ = fr._split_state(strategy, local)
                if field not in elem:
                    missing = True
                    continue
                src = elem[field]
            pieces += [(start, end, take(src)) for start, end, take in frags]
    finally:
        if strategy.stage == 3:
            strategy.unbind_segments()
    return None if missing and not pieces else pieces


def _grad_pieces(strategy, key) -> list[Piece] | None:
    """This rank's pieces of the reduced gradient (the fp32 one the step reads), or None if none is held:
    only between a reducing backward (`strategy.finish()`) and the step's `disarm()` (stage 1 in fp32
    keeps a zeroed gradient buffer at all times; it is no gradient before a backward)."""
    from ..zero.data_parallel import ReducePhase

    if strategy.phase is not ReducePhase.FINISHED:
        return None
    rank, world = _rank_world(strategy)
    if strategy.stage == 0:
        from ..zero.stage3_params import flat_layout

        strategy._link_master_grads()  # mixed precision: the masters' fp32 .grad (materialized)
        masters = list(getattr(strategy, "master_params", None) or strategy.params)
        g = masters[key].grad
        if g is None:
            return None
        lo, hi = flat_layout([m.numel() for m in masters], world).param_shard_range(key, rank)
        return [(lo, hi, g.reshape(-1)[lo:hi])] if hi > lo else []
    if strategy.stage in (1, 2):
        strategy.grads.materialize()
        pg, layout = strategy.grads.partition_grad, strategy.layout
        if pg is None:
            return None
        out = []
        for f in layout.fragments(rank):
            if f.index == key:
                base = layout.shard_range(f.chunk, rank)[0]
                out.append((f.param_offset, f.param_offset + f.numel, pg[f.chunk, f.flat_start - base:f.flat_end - base]))
        return out
    unit = key.unit
    unit.materialize_grad()
    g = unit.shard.grad
    if g is None:
        return None
    lo, hi = unit.layout.param_shard_range(key.index, rank)
    first = unit.layout.rank_range(rank)[0]
    return [(lo, hi, g[key.offset + lo - first:key.offset + hi - first])] if hi > lo else []


def _pieces(strategy, key, field: str) -> list[Piece] | None:
    return _grad_pieces(strategy, key) if field == GRAD else _value_pieces(strategy, key, field)


# -- full values ---------------------------------------------------------------------------------------
def _full(param: torch.Tensor, field: str) -> torch.Tensor | None:
    strategy, key, shape = _locate(param)
    if strategy is None:
        return None
    from ..comm.ops import all_reduce

    numel = 1
    for s in shape:
        numel *= s
    pieces = _pieces(strategy, key, field)
    buf = torch.zeros(numel + 1, dtype=torch.float32, device=_device(strategy, param))
    if pieces:  # a rank owning nothing of the parameter flags nothing
        with torch.no_grad():
            for start, end, t in pieces:
                buf[start:end] = t.detach().to(buf.dtype)
        buf[numel] = 1.0
    all_reduce(buf, group=getattr(strategy, "group", None), logger=getattr(strategy, "logger", None))
    if float(buf[numel]) == 0.0:
        return None
    return buf[:numel].view(shape)


def _device(strategy, param: torch.Tensor) -> torch.device:
    if strategy.stage == 3:
        return param.device
    return strategy.params[0].device


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The full fp32 master value of `param`, in its shape, on every rank. Collective."""
    return _full(param, MASTER)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The full reduced fp32 gradient of `param` (after backward, before step), on every rank. Collective."""
    return _full(param, GRAD)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The full optimizer state `optim_state_key` (e.g. "exp_avg", "exp_avg_sq") of `param`. Collective."""
    return _full(param, optim_state_key)


# -- writes -------------------------------------------------------------------------------------------
def _write(param: torch.Tensor, value: torch.Tensor, field: str) -> bool:
    strategy, key, shape = _locate(param)
    if strategy is None:
        return False
    value = torch.as_tensor(value)
    if tuple(value.shape) != shape and value.numel() != _numel(shape):
        raise ValueError(f"value of shape {tuple(value.shape)} does not fit a parameter of shape {shape}")
    flat = value.detach().reshape(-1)
    pieces = _value_pieces(strategy, key, field, write=True)
    if pieces is None:
        raise KeyError(f"the optimizer keeps no state {field!r} for this parameter (yet: states exist after "
                       "the first step)")
    with torch.no_grad():
        for start, end, t in pieces:
            t.copy_(flat[start:end].to(device=t.device, dtype=t.dtype))
    return True


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the fp32 master of `param` to the full `value` (same on every rank) and make the compute
    parameters follow. Collective (the refresh) at stages >= 1; does nothing for an unmanaged parameter."""
    if _write(param, value, MASTER):
        strategy, _, _ = _locate(param)
        strategy.refresh_params_from_master()


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set optimizer state `optim_state_key` of `param` to the full `value` (same on every rank). Local."""
    _write(param, value, optim_state_key)


# -- local (this rank's) fragments ---------------------------------------------------------------------
def _local(param: torch.Tensor, field: str) -> torch.Tensor | None:
    """This rank's fragments of the field, concatenated in element order (1-D, maybe empty). Local."""
    strategy, key, _ = _locate(param)
    if strategy is None:
        return None
    pieces = _pieces(strategy, key, field)
    if pieces is None:
        return None
    pieces = sorted(pieces, key=lambda p: p[0])
    if not pieces:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat([t.detach().reshape(-1) for _, _, t in pieces]).clone()


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of `param`'s fp32 master (1-D, the elements it owns in order). Not collective."""
    return _local(param, MASTER)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of `param`'s reduced gradient (1-D). Not collective."""
    return _local(param, GRAD)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's part of `param`'s optimizer state `optim_state_key` (1-D). Not collective."""
    return _local(param, optim_state_key)
