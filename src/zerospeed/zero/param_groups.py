"""Parameter groups through partitioning: which group each parameter is in, and the optimizer's tensors.

The user's optimizer (from the config, a client object or a client callable) is built over the model's
own parameters, as in plain PyTorch, so its `param_groups` are the user's groups in the user's order
with their hyperparameters (weight decay on matrices, none on biases/LayerNorm; a learning rate per
group). A ZeRO stage then *re-targets* it: each group's "params" list is replaced by the tensors this
rank updates for that group (stage 0: the fp32 masters of its parameters; stages 1-3: *segments*,
contiguous column ranges of the rank's flat fp32 partition that hold only that group's elements), and
the state is cleared. The object the user holds is the one that steps, so a scheduler that writes
`param_groups[i]["lr"]` (torch's, DeepSpeed's, transformers') acts per group, and one built on the
client optimizer before `initialize` keeps working. DeepSpeed does the same (its ZeRO optimizers
replace `param_group["params"]` with flat partitions); elementwise optimizers (Adam, AdamW, SGD,
Lion, ...) then compute exactly what they compute on the unpartitioned parameters.

Segments are planned by a pure function (`merge_segments`): the pieces of parameters inside one flat
source (a stage-1/2 partition row, a stage-3 unit shard), in order, merged while they belong to the
same group; the first segment of a source starts at column 0 and the last one ends at its width, so
padding joins a neighbour and one group gives one segment per source (the layout without groups).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..optim.factory import guard_fused_cpu

__all__ = ["Segment", "by_group", "check_optimizer_params", "group_index", "merge_segments", "retarget", "swapped_builder"]


@dataclass(frozen=True)
class Segment:
    """Columns [start, end) of flat source `source` (a partition row or a unit shard), all in param group
    `group` (an index into `optimizer.param_groups`). Elements."""

    source: int
    start: int
    end: int
    group: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def merge_segments(pieces: Iterable[tuple[int, int, int, int]], widths: Sequence[int]) -> list[Segment]:
    """Segments from `pieces` = (source, start, end, group) in increasing (source, start) order, each the
    columns of one parameter fragment; `widths[s]` = columns of source s. Consecutive pieces of one
    group in one source merge; a source's first segment starts at 0 and each segment ends where the
    next begins (its last at widths[s]), so the segments of a source tile it exactly. A source with no
    piece (only padding) gets no segment. Pure. Raises ValueError for overlapping or unordered pieces."""
    out: list[Segment] = []
    last: tuple[int, int] = (-1, 0)
    for source, start, end, group in pieces:
        if (source, start) < last or end < start:
            raise ValueError(f"pieces must be disjoint and in order: ({source}, {start}, {end}) after {last}")
        last = (source, end)
        if out and out[-1].source == source:
            if out[-1].group == group:
                continue
            prev = out[-1]
            out[-1] = Segment(prev.source, prev.start, start, prev.group)  # ends where this group begins
            out.append(Segment(source, start, end, group))
        else:
            if out:
                prev = out[-1]
                out[-1] = Segment(prev.source, prev.start, widths[prev.source], prev.group)
            out.append(Segment(source, 0, end, group))
    if out:
        prev = out[-1]
        out[-1] = Segment(prev.source, prev.start, widths[prev.source], prev.group)
    return out


def group_index(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], names: Sequence[str]) -> list[int]:
    """For each of `params` (the strategy's trainable parameters, named `names`), the index of the
    optimizer param group holding it. Raises ValueError naming a parameter that no group or two groups
    hold, or a group tensor that is not one of `params`."""
    where: dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for t in group["params"]:
            if id(t) in where and where[id(t)] != g:
                raise ValueError(f"a parameter is in optimizer param groups {where[id(t)]} and {g}; put each in one")
            where[id(t)] = g
    ours = {id(p) for p in params}
    stray = [k for k in where if k not in ours]
    if stray:
        raise ValueError(f"the optimizer holds {len(stray)} tensor(s) that are not trainable parameters of the model "
                         "(requires_grad=True); build it over model parameters only")
    missing = [n for p, n in zip(params, names) if id(p) not in where]
    if missing:
        raise ValueError(f"{len(missing)} trainable parameter(s) are in no optimizer param group (e.g. "
                         f"{', '.join(missing[:3])}); add them to a group, or freeze them with requires_grad=False")
    return [where[id(p)] for p in params]


def check_optimizer_params(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> None:
    """Raise ValueError unless every tensor in `optimizer`'s groups is a trainable parameter of `module`."""
    names = {id(p): n for n, p in module.named_parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for t in group["params"]:
            if id(t) not in names:
                raise ValueError(f"optimizer param group {g} holds a tensor of shape {tuple(t.shape)} that is not a "
                                 "parameter of the model; build the optimizer over model.parameters() (or groups of them)")
            if not t.requires_grad:
                raise ValueError(f"optimizer param group {g} holds {names[id(t)]!r}, which is frozen "
                                 "(requires_grad=False); leave frozen parameters out of the optimizer")


def retarget(optimizer: torch.optim.Optimizer, tensors: Sequence[Sequence[torch.Tensor]]) -> torch.optim.Optimizer:
    """Make group g of `optimizer` update `tensors[g]` (this rank's tensors of that group, possibly none)
    instead of the model parameters; clears the optimizer state (none exists before the first step).
    Hyperparameters and the group order stay the user's. Returns `optimizer`."""
    if len(tensors) != len(optimizer.param_groups):
        raise ValueError(f"{len(tensors)} tensor lists for {len(optimizer.param_groups)} param groups")
    for group, ts in zip(optimizer.param_groups, tensors):
        group["params"] = list(ts)
    optimizer.state = defaultdict(dict)
    return guard_fused_cpu(optimizer)  # the new tensors may live on the host (offload) where the model did not


def swapped_builder(optimizer: torch.optim.Optimizer | None):
    """`make_optimizer` for the NVMe optimizer tier (`offload.SwappedOptimizer`), which steps placeholders
    it makes itself (one per tile, each tile inside one group's range): re-targets `optimizer` to them,
    group by group. None without an optimizer."""
    if optimizer is None:
        return None

    def build(params):
        if params and isinstance(params[0], dict):  # one dict per group (num_groups > 1)
            return retarget(optimizer, [d["params"] for d in params])
        return retarget(optimizer, [list(params)])
    return build


def by_group(items: Iterable[tuple[int, torch.Tensor]], num_groups: int) -> list[list[torch.Tensor]]:
    """[(group, tensor), ...] -> one list per group, in the items' order."""
    out: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
    for g, t in items:
        out[g].append(t)
    return out
