"""The global gradient norm and clipping: one function for every ZeRO stage.

`clip_and_norm(grads, max_norm, groups=...)` takes this rank's part of the gradient and the process
groups over which the parts are disjoint: stage 0 passes its complete (all-reduced) gradients and no
group; stages 1-2 their [K, S] gradient partition and the data-parallel group; stage 3 its unit
shards and the data-parallel group. Each strategy's `clip_and_norm` only unscales and collects its
tensors. It lives in `zero/` (not `optim/`) because the strategies call it and `zero` sits below
`optim` in the layering (DESIGN.md).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.logger import CommsLogger
from ..comm.ops import all_reduce

NORM_BLOCK = 1 << 16  # elements per fp32 partial norm in `sum_of_squares`


def sum_of_squares(tensors: list[torch.Tensor], block: int = NORM_BLOCK) -> torch.Tensor:
    """Sum of the squares of every element of `tensors` (any shapes and strides, on one device), as a
    1-element float64 tensor: fp32 2-norms of `block`-element pieces of each row, squared and summed in
    float64.

    One fp32 norm over millions of elements loses about 1e-4 of the value (measured: 3.25M normal
    values), and casting the whole gradient to float64 first costs 30x the time (21 ms against 0.75
    ms for a strided [2, 3.25M] fp32 view, 1 thread: the ZeRO 1-2 partition gradient is such a view);
    64K-element pieces keep the error at fp32 rounding (4e-7 of the sum). inf/nan propagate, so the
    result is the overflow signal too."""
    pieces = []
    for t in tensors:
        rows = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
        for row in rows:
            pieces.extend(row.split(block))
    out = torch.zeros(1, dtype=torch.float64, device=tensors[0].device if tensors else None)
    if pieces:
        out += torch.stack(torch._foreach_norm(pieces)).double().square().sum()
    return out


@dataclass(frozen=True)
class ModelParallelGrads:
    """How a model-parallel (tensor-parallel) run splits the gradient across `group` (`size` ranks): every
    parameter not in `replicated` is a disjoint shard per rank (its squares are summed over the group);
    those in `replicated` are whole and identical on every rank of the group (their squares count once:
    weighted 1/size before the sum). Built by `zerospeed.initialize` from the tensor-parallel layers."""

    group: dist.ProcessGroup | None
    size: int
    replicated: frozenset  # id() of the replicated parameters
    # id() of parameters whose identical gradient another rank of the group holds and counts (a pipeline's
    # tied weights on every stage but the first holding them): not counted here
    excluded: frozenset = frozenset()


def clip_and_norm(grads: list[torch.Tensor], max_norm: float, *,
                  groups: Sequence[dist.ProcessGroup | None] = (), logger: CommsLogger | None = None,
                  replicated: Sequence[torch.Tensor] = (), replicas: int = 1,
                  excluded: Sequence[torch.Tensor] = (), clip: Sequence[torch.Tensor] | None = None,
                  squares: torch.Tensor | None = None, on_clip=None) -> float:
    """Global gradient 2-norm; clip `grads` in place to `max_norm` if it is > 0 and the norm is finite.

    grads: this rank's part of the gradient (any shapes/strides/dtypes, one device; padding must be
    zero), disjoint from the other ranks' parts over `groups`. groups: the process groups to sum the
    squares over, in turn (`None` = the default group, the world); empty: `grads` is the complete
    gradient on this rank and no collective runs. ZeRO stages 1-3 pass their partition/shards and
    `(dp_group,)`; stage 0 its all-reduced gradients and `()`. A tensor-parallel run appends the
    tensor-parallel group and passes its replicated parameters' views as `replicated` (below), so a
    sharded parameter counts as the sum over its shards and a replicated one once. logger: counts
    the all-reduces. replicated / replicas: views (within `grads`) of
    gradients that `replicas` ranks of the last group hold identically (a tensor-parallel run's
    replicated parameters: norms, embeddings); their squares are weighted 1/replicas, so after the sum
    over that group each counts once (`ModelParallelGrads`). excluded: views (within `grads`) whose
    squares another rank counts (weight 0 here: a pipeline's tied weights). clip: the tensors to scale when
    clipping, if not `grads` themselves (stage 0 with experts norms its owned slices but clips whole gradients).
    squares: the sum of squares (float64 [1]) of this rank's gradient parts that are not in memory
    (ZeRO-Infinity's gradients on NVMe, `offload.SwappedGrads`), added to that of `grads`; on_clip:
    called with the clip coefficient (0-d fp32 tensor) when clipping, to scale those parts.

    Algorithm: `sum_of_squares` (fp32 norms of 64K-element pieces, summed in float64), one 1-element
    all-reduce per group, sqrt; clip coefficient min(1, max_norm / (norm + 1e-6)) in fp32, as
    `torch.nn.utils.clip_grad_norm_` (source: torch.nn.utils.clip_grad._clip_grads_with_norm_), so
    the result equals `clip_grad_norm_` on the full gradient up to its fp32 rounding. Returns the
    norm as a float (float64 precision); a non-finite norm (any rank's part had inf/nan: the overflow
    signal, the same on every rank) is returned as-is and nothing is clipped. Collective over each
    group: every rank of it must call.
    """
    sq = sum_of_squares(grads)
    if squares is not None:
        sq += squares.to(sq.device)
    if replicas > 1 and replicated:  # views into `grads` that `replicas` ranks of the last group hold alike
        sq -= (1.0 - 1.0 / replicas) * sum_of_squares(list(replicated))
    if excluded:
        sq -= sum_of_squares(list(excluded))
    for group in groups:
        all_reduce(sq, group=group, logger=logger)
    norm = math.sqrt(float(sq))
    targets = list(grads if clip is None else clip)
    if max_norm > 0 and (targets or on_clip is not None) and math.isfinite(norm):
        coef = torch.clamp(max_norm / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
        if targets:
            torch._foreach_mul_(targets, coef.to(targets[0].device))
        if on_clip is not None:
            on_clip(coef)
    return norm
