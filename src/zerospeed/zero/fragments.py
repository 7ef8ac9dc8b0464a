"""What each rank owns of the logical (per-parameter) training state, for topology-independent checkpoints.

A checkpoint stores *logical* tensors: per trainable parameter (keyed by its canonical name in
`module.named_parameters()`, tied weights once) the fp32 master weight and every optimizer state of
the same shape (Adam's `exp_avg`, `exp_avg_sq`), plus 0-d states (Adam's `step`). Each rank writes the
*fragments* it owns: flat element ranges [start, end) of a flattened logical tensor. Ownership:

* stage 0: every rank holds everything; to spread the writing, the parameters are laid back to back
  (registration order) and rank r of the data-parallel group owns the r-th of N equal contiguous
  slices of that flat space. Loading gives every rank every element.
* stages 1/2: the fragments of `FlatPartition.fragments(rank)`: the pieces of parameters inside the
  rank's shard of each chunk; the master is the rank's partition ([K, S]), a fragment is a row slice.
* stage 3: for every gather unit, the pieces of its parameters inside the rank's flat shard.

Loading is the same walk with the ranges this rank owns *now*; the reader returns any flat range of a
logical tensor whatever world size and stage wrote it, so no conversion step exists.

Each strategy owns its part (the `ZeroStrategy` checkpoint protocol, strategy.py): `checkpoint_params()`
(every trainable parameter with its full shape and master dtype) and `checkpoint_slots(names, load=...)`
(the tensors the optimizer updates, the fp32 masters, each with the logical fragments inside it; built
with `logical`, `flat_view` and `segment_slots` below), `release_checkpoint_slots()` and
`refresh_params_from_master()` (collective: master -> low-precision parameters, then re-gather, as after
a step; the checkpoint code calls it after loading masters). This module holds only what is the same
for every stage: slot -> fragment, the optimizer-state split, and the load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch
from torch import nn


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
Names = dict[int, tuple[str, tuple[str, ...]]]  # id(parameter) -> (canonical name, aliases): `param_names`


@dataclass
class Slot:
    """One tensor the optimizer updates (`local`: a master, or a segment of one) and the logical
    fragments inside it: (param, start, end, take), elements [start, end) of the flattened logical
    parameter being `take(local)` (and `take(state)` for each optimizer state of local's shape)."""

    local: torch.Tensor
    frags: list[tuple[LogicalParam, int, int, Take]]


def param_names(module: nn.Module) -> Names:
    """id(parameter) -> (canonical name, aliases): the first name in `named_parameters()` order wins."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {k: (v[0], tuple(v[1:])) for k, v in names.items()}


def logical(names: Names, p: torch.Tensor, shape, dtype: torch.dtype) -> LogicalParam:
    """The LogicalParam of model parameter `p` (full `shape`, master `dtype`). KeyError if `names` lacks it."""
    name, aliases = names[id(p)]
    return LogicalParam(name, aliases, tuple(shape), dtype)


def flat_view(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` as a 1-D view. Raises RuntimeError (naming `what`) if it is not contiguous."""
    if not t.is_contiguous():
        raise RuntimeError(f"{what} is not contiguous (strides {t.stride()}); checkpoint fragments are flat views")
    return t.view(-1)


def segment_slots(segments, tensors: list[torch.Tensor], pieces) -> list[Slot]:
    """One slot per optimizer segment (`segments`, aligned with `tensors` = the strategy's `master_params`,
    both in (source, start) order); `pieces` = (source, col_start, col_end, LogicalParam, param_start) in
    the same order, each inside exactly one segment (`param_groups.merge_segments` guarantees it)."""
    frags: list[list] = [[] for _ in segments]
    i = 0
    for source, lo, hi, lp, p_start in pieces:
        while (segments[i].source, segments[i].end) <= (source, lo):
            i += 1
        seg = segments[i]
        take = (lambda a, b: lambda t: t[a:b])(lo - seg.start, hi - seg.start)
        frags[i].append((lp, p_start, p_start + hi - lo, take))
    return [Slot(t, fr) for t, fr in zip(tensors, frags)]


# -- stage-independent: the ZeroStrategy checkpoint methods (strategy.py) delegate here ----------------
def logical_params(strategy, module: nn.Module, translate=None) -> list[LogicalParam]:
    """Every trainable parameter, canonical order (same on every rank). translate: a tensor-parallel
    translation (`runtime.checkpoint_tp.TPTranslation`: `full_shape(name, shape)`, `frags(frags, load=)`)
    whose full shapes replace the local shard shapes, or None."""
    names = param_names(module)
    out = [logical(names, p, shape, dtype) for p, shape, dtype in strategy.checkpoint_params()]
    if translate is not None:
        rename = getattr(translate, "global_name", None)  # experts: local name -> global expert id
        out = [LogicalParam(rename(lp.name) if rename else lp.name, lp.aliases,
                            translate.full_shape(lp.name, lp.shape), lp.dtype) for lp in out]
    return out


def split_state(strategy, local: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
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


def owned_fragments(strategy, module: nn.Module, translate=None) -> Iterator[OwnedFragment]:
    """Everything this rank owns, as disjoint fragments: over all ranks they cover each element of
    every logical master / elementwise state exactly once (translate: see `logical_params`)."""
    for slot in strategy.checkpoint_slots(param_names(module), load=False):
        elem, scal = split_state(strategy, slot.local)
        frags = slot.frags if translate is None else translate.frags(slot.frags, load=False)
        for lp, start, end, take in frags:
            yield OwnedFragment(lp.name, lp.shape, start, end, take(slot.local.detach()),
                                {k: take(v) for k, v in elem.items()}, dict(scal) if start == 0 else {})


def _copy(dst: torch.Tensor, src: torch.Tensor | None) -> None:
    if src is not None:
        dst.copy_(src)


def load_owned_fragments(strategy, module: nn.Module, reader: FragmentReader, *, optimizer_states: bool = True,
                         translate=None) -> None:
    """Fill this rank's masters (and, if `optimizer_states` and the checkpoint has them, its optimizer
    states, creating them when the optimizer has not stepped yet) from `reader`. Local only: call
    `refresh_params_from_master()` (collective) afterwards."""
    opt = strategy.optimizer
    states = optimizer_states and opt is not None and bool(reader.elementwise_states or reader.scalar_states)
    with torch.no_grad():
        for slot in strategy.checkpoint_slots(param_names(module), load=True):
            local = slot.local.detach()
            if translate is not None:
                slot = Slot(slot.local, translate.frags(slot.frags, load=True))
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
