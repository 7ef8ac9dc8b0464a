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
else to the most recently built one holding it (`strategy.locate(param)`). What a rank owns comes from
the strategy's checkpoint protocol (`checkpoint_slots`, `reduced_grad_pieces`; `zero/strategy.py`), and the
group the all-reduce runs over from `strategy.fragment_group(key)`: the data-parallel group, except for an
expert with expert parallelism (its expert-data group: the ranks holding the same experts; each rank gets
its own experts' values, as DeepSpeed's expert parameters).
"""
from __future__ import annotations

import math

import torch

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
           "safe_get_local_grad", "safe_get_local_optimizer_state"]

MASTER, GRAD = "master", "grad"  # fields besides optimizer-state names

Piece = tuple[int, int, torch.Tensor]  # (start, end, 1-D tensor of end - start elements) of the flattened param


def _locate(param: torch.Tensor):
    """(strategy, key, full shape, device for the full value) for `param`, or (None, None, None, None)."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"expected a model parameter (torch.Tensor), got {type(param).__name__}")
    from ..zero import stage3_context as ctx

    s, sp = ctx._find(param)  # the live stage-3 strategies (they register there)
    if s is not None:
        return (s, *s.locate(param))
    for s in reversed(ctx.live_strategies()):
        found = s.locate(param)
        if found is not None:
            return (s, *found)
    return None, None, None, None


# -- what this rank owns of one parameter ------------------------------------------------------------
def _value_slots(strategy, param: torch.Tensor, *, write: bool = False):
    """[(local tensor the optimizer updates, [(start, end, take)])] for `param`: the strategy's
    checkpoint slots (`ZeroStrategy.checkpoint_slots`) restricted to one parameter. write: at stage 0
    every rank holds (and must write) the whole replicated value, as a checkpoint load does. The caller
    calls `strategy.release_checkpoint_slots()` when done."""
    params = [p for p, _, _ in strategy.checkpoint_params()]
    names = {id(p): (str(i), ()) for i, p in enumerate(params)}
    want = names[id(param)][0]
    out = []
    for slot in strategy.checkpoint_slots(names, load=write):
        mine = [(start, end, take) for lp, start, end, take in slot.frags if lp.name == want]
        if mine:
            out.append((slot.local, mine))
    return out


def _check_reachable(strategy) -> None:
    if strategy.swapped is not None:
        raise NotImplementedError("safe_get/set_* cannot reach masters or optimizer states offloaded to NVMe "
                                  "(zero_optimization.offload_optimizer.device=nvme); use device \"cpu\" or none")


def _value_pieces(strategy, param, field: str, *, write: bool = False) -> list[Piece] | None:
    """This rank's pieces of the master (field "master") or of optimizer state `field`; None if this
    rank holds fragments but not that state."""
    _check_reachable(strategy)
    from ..zero import fragments as fr

    pieces, missing = [], False
    try:
        for local, frags in _value_slots(strategy, param, write=write):
            if field == MASTER:
                src = local.detach()
            else:
                elem, _ = fr.split_state(strategy, local)
                if field not in elem:
                    missing = True
                    continue
                src = elem[field]
            pieces += [(start, end, take(src)) for start, end, take in frags]
    finally:
        strategy.release_checkpoint_slots()
    return None if missing and not pieces else pieces


def _grad_pieces(strategy, key) -> list[Piece] | None:
    """This rank's pieces of the reduced gradient (the fp32 one the step reads), or None if none is held:
    only between a reducing backward (`strategy.finish()`) and the step's `disarm()` (stage 1 in fp32
    keeps a zeroed gradient buffer at all times; it is no gradient before a backward)."""
    from ..zero.data_parallel import ReducePhase

    if strategy.phase is not ReducePhase.FINISHED:
        return None
    return strategy.reduced_grad_pieces(key)


def _pieces(strategy, param, key, field: str) -> list[Piece] | None:
    return _grad_pieces(strategy, key) if field == GRAD else _value_pieces(strategy, param, field)


# -- full values ---------------------------------------------------------------------------------------
def _full(param: torch.Tensor, field: str) -> torch.Tensor | None:
    strategy, key, shape, device = _locate(param)
    if strategy is None:
        return None
    from ..comm.ops import all_reduce

    numel = 1
    for s in shape:
        numel *= s
    pieces = _pieces(strategy, param, key, field)
    buf = torch.zeros(numel + 1, dtype=torch.float32, device=device)
    if pieces:  # a rank owning nothing of the parameter flags nothing
        with torch.no_grad():
            for start, end, t in pieces:
                buf[start:end] = t.detach().to(buf.dtype)
        buf[numel] = 1.0
    all_reduce(buf, group=strategy.fragment_group(key), logger=strategy.logger)
    if float(buf[numel]) == 0.0:
        return None
    return buf[:numel].view(shape)


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
    strategy, _, shape, _ = _locate(param)
    if strategy is None:
        return False
    value = torch.as_tensor(value)
    if tuple(value.shape) != shape and value.numel() != math.prod(shape):
        raise ValueError(f"value of shape {tuple(value.shape)} does not fit a parameter of shape {shape}")
    flat = value.detach().reshape(-1)
    pieces = _value_pieces(strategy, param, field, write=True)
    if pieces is None:
        raise KeyError(f"the optimizer keeps no state {field!r} for this parameter (yet: states exist after "
                       "the first step)")
    with torch.no_grad():
        for start, end, t in pieces:
            t.copy_(flat[start:end].to(device=t.device, dtype=t.dtype))
    return True


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the fp32 master of `param` to the full `value` (same on every rank) and make the compute
    parameters follow. Collective (the refresh) at stages >= 1; does nothing for an unmanaged parameter."""
    if _write(param, value, MASTER):
        strategy = _locate(param)[0]
        strategy.refresh_params_from_master()


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set optimizer state `optim_state_key` of `param` to the full `value` (same on every rank). Local."""
    _write(param, value, optim_state_key)


# -- local (this rank's) fragments ---------------------------------------------------------------------
def _local(param: torch.Tensor, field: str) -> torch.Tensor | None:
    """This rank's fragments of the field, concatenated in element order (1-D, maybe empty). Local."""
    strategy, key, _, _ = _locate(param)
    if strategy is None:
        return None
    pieces = _pieces(strategy, param, key, field)
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
