"""Collectives a compiled graph can hold: the all-reduce and all-gather of a tensor-parallel decode step.

Under `torch.compile` an eager `dist.all_reduce` would split the graph at every layer, so a compiled step needs
collectives the compiler traces. torch's own are the functional collectives (`_functional_collectives`), used
here on every backend but gloo. On gloo (CPU) they are slow for the decode step's tiny messages, and
inductor's C++ wrapper cannot call them in torch 2.13 ("NotImplementedError: arg type Any is not yet supported
by custom_op_wrapper"). On gloo a step's collectives are therefore two custom ops, `zerospeed::message_all_reduce`
and `zerospeed::message_all_gather`, each one isend to and one irecv from every other rank of the group
(`comm.ops._messages`, the point-to-point form the ZeRO all-gather and reduce-scatter already use on gloo),
which the compiler keeps as opaque calls and the C++ wrapper can call.

Measured (2 ranks, 1 thread each, gloo, a [1, 768] fp32 tensor, medians of 5 x 200 calls): 0.19-0.28 ms per
exchange of messages against 0.59-1.96 ms per `dist.all_reduce`; interleaved with a 9 MB GEMV per call,
1.9-2.3 against 2.3-2.7 ms per iteration. A 124M GPT-2 decoding at tp 2, batch 1 (25 all-reduces and one
all-gather per token), these ops with the C++ wrapper against the functional collectives with the Python
wrapper, 3 interleaved launch pairs: 0.86, 0.96 and 0.94x the time per token (session 25, bench/README.md).

Both sum or concatenate in rank order, so every rank gets bit-identical results (tensor-parallel ranks must
agree on every hidden state, or their greedy tokens part). World sizes above 2 send N - 1 messages per rank
instead of a ring's 2 (N - 1) / N tensor volumes: fine for latency-bound decode messages, not for training's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed.distributed_c10d import _resolve_process_group

from .ops import _messages, _point_to_point

__all__ = ["traced_all_reduce", "traced_all_gather", "needs_python_wrapper"]

_ALL_REDUCE_TAG, _ALL_GATHER_TAG = 3, 4  # comm.ops uses 1 and 2; gloo matches messages per (pair, tag)


def _exchange(x: torch.Tensor, group_name: str, tag: int) -> list[torch.Tensor]:
    """Every rank's `x` of the group, in rank order (this rank's own is `x` itself)."""
    group = _resolve_process_group(group_name)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    parts = [x if r == rank else torch.empty_like(x) for r in range(world)]
    _messages(group, lambda dst: x, lambda j, src: parts[src], tag).wait()
    return parts


# A custom op cannot take a ProcessGroup: it takes the group's name (`group.group_name`, as torch's functional
# collectives do), and the all-gather its size, so a compiled graph (and inductor's cache key) holds both.
@torch.library.custom_op("zerospeed::message_all_reduce", mutates_args=())
def message_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum over the group of every rank's `x` (any shape), summed in rank order; a new tensor."""
    parts = _exchange(x, group_name, _ALL_REDUCE_TAG)
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out


@message_all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("zerospeed::message_all_gather", mutates_args=())
def message_all_gather(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """Every rank's `x` [..., n] concatenated in rank order along the last dimension: [..., group_size * n]."""
    return torch.cat(_exchange(x, group_name, _ALL_GATHER_TAG), dim=-1)


@message_all_gather.register_fake
def _(x, group_name, group_size):
    return x.new_empty((*x.shape[:-1], x.shape[-1] * group_size))


def _resolve(group):
    return group if group is not None else dist.group.WORLD


def traced_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `x` [...] over `group` (None: the world) inside a compiled graph: a new tensor of x's shape."""
    group = _resolve(group)
    if _point_to_point(group):
        return message_all_reduce(x, group.group_name)
    return funcol.all_reduce(x.contiguous(), "sum", group)


def traced_all_gather(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's `x` [..., n] along the last dimension inside a compiled graph: [..., world * n]."""
    group = _resolve(group)
    if _point_to_point(group):
        return message_all_gather(x, group.group_name, dist.get_world_size(group))
    return funcol.all_gather_tensor(x.contiguous(), gather_dim=x.dim() - 1, group=group)


def needs_python_wrapper(group: dist.ProcessGroup | None) -> bool:
    """True when a compiled step's collectives over `group` are torch's functional collectives, which
    inductor's C++ wrapper cannot call (torch 2.13): every backend but gloo."""
    return not _point_to_point(_resolve(group))
