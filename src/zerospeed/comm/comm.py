"""DeepSpeed's `deepspeed.comm` functions: `import zerospeed.comm as dist` in place of `import deepspeed.comm as dist`.

Thin wrappers over `torch.distributed` with DeepSpeed's names, argument order and defaults (group=None
is the default, world group; ranks given to send/recv/broadcast/reduce are global ranks, as in
torch.distributed). Each collective runs inside `torch.profiler.record_function("zerospeed::<name>")`.
With `async_op=True` a collective returns torch's `Work` handle (call `.wait()`), else None.

Before a process group exists, `get_rank`/`get_world_size`/`barrier`/every collective raise
RuntimeError naming the fix (DeepSpeed asserts "DeepSpeed backend not set, please initialize it using
init_process_group()"); `get_local_rank`, `is_initialized` and `is_available` work at any time.

`ReduceOp` is `torch.distributed.ReduceOp`; `ReduceOp.AVG`, which the gloo backend lacks, runs there
as a SUM divided by the group size (integer tensors: floor division).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .init import init_distributed, read_launch_env

__all__ = [
    "ReduceOp", "init_distributed", "is_initialized", "is_available", "destroy_process_group",
    "get_rank", "get_world_size", "get_local_rank", "get_global_rank", "get_world_group",
    "get_all_ranks_from_group", "new_group", "barrier", "all_reduce", "inference_all_reduce", "broadcast",
    "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
]

ReduceOp = dist.ReduceOp


def _require_init(what: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"zerospeed.comm.{what}() needs a process group: call zerospeed.comm.init_distributed() "
                           "(or zerospeed.initialize(...), or torch.distributed.init_process_group) first")


def is_available() -> bool:
    """True if this torch build has torch.distributed."""
    return dist.is_available()


def is_initialized() -> bool:
    """True once the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """Destroy `group` (None: the default group and every other group)."""
    dist.destroy_process_group(group)


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in `group` (None: the world). Raises RuntimeError before init."""
    _require_init("get_rank")
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in `group` (None: the world). Raises RuntimeError before init."""
    _require_init("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """Rank on this node, from the launcher's environment (LOCAL_RANK, SLURM_LOCALID, or Open MPI's
    OMPI_COMM_WORLD_LOCAL_RANK); 0 for a plain `python train.py`. Needs no process group."""
    env = read_launch_env()
    if env.source == "none" and "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:
        return int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    return env.local_rank


def get_global_rank(group: dist.ProcessGroup | None = None, group_rank: int = 0) -> int:
    """The global rank of rank `group_rank` of `group` (None: the world, where both are the same)."""
    _require_init("get_global_rank")
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_world_group() -> dist.ProcessGroup:
    """The default (world) process group."""
    _require_init("get_world_group")
    return dist.group.WORLD


def get_all_ranks_from_group(group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    return [get_global_rank(group, r) for r in range(get_world_size(group))]


def new_group(ranks: list[int] | None = None, **kwargs) -> dist.ProcessGroup:
    """A new process group of the global `ranks` (every rank must call it, members or not);
    keyword arguments go to `torch.distributed.new_group`."""
    _require_init("new_group")
    return dist.new_group(ranks, **kwargs)


def barrier(group: dist.ProcessGroup | None = None, async_op: bool = False, device_ids=None):
    """Block until every rank of `group` reached this call."""
    _require_init("barrier")
    with record_function("zerospeed::barrier"):
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


class _DivideAfter:
    """A `Work`-like handle: waits for the SUM, then divides by the group size (AVG on gloo)."""

    def __init__(self, work, tensor: torch.Tensor, size: int):
        self.work, self.tensor, self.size = work, tensor, size

    def wait(self, timeout=None) -> bool:
        if self.tensor is not None:
            self.work.wait() if timeout is None else self.work.wait(timeout)
            _divide(self.tensor, self.size)
            self.tensor = None
        return True

    def is_completed(self) -> bool:
        return self.tensor is None or self.work.is_completed()


def _divide(tensor: torch.Tensor, size: int) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(size)
    else:
        tensor.floor_divide_(size)


def _emulate_avg(op, group) -> bool:
    return op == ReduceOp.AVG and dist.get_backend(group) == dist.Backend.GLOO


def _reduce_like(name: str, fn, tensor: torch.Tensor, op, group, async_op: bool, **kw):
    _require_init(name)
    emulate = _emulate_avg(op, group)
    with record_function(f"zerospeed::{name}"):
        work = fn(op=ReduceOp.SUM if emulate else op, group=group, async_op=async_op, **kw)
    if not emulate:
        return work
    if async_op:
        return _DivideAfter(work, tensor, dist.get_world_size(group))
    _divide(tensor, dist.get_world_size(group))
    return None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group: dist.ProcessGroup | None = None,
               async_op: bool = False):
    """In place: `tensor` (any shape, the same on every rank) becomes the `op`-reduction over `group`."""
    return _reduce_like("all_reduce", lambda **kw: dist.all_reduce(tensor, **kw), tensor, op, group, async_op)


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group: dist.ProcessGroup | None = None):
    """DeepSpeed's all-reduce for inference kernels: here the same as a blocking `all_reduce`."""
    return all_reduce(tensor, op=op, group=group)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group: dist.ProcessGroup | None = None,
           async_op: bool = False):
    """The `op`-reduction of `tensor` over `group` lands in `tensor` on global rank `dst` (other ranks'
    `tensor` is left undefined, as in torch.distributed)."""
    emulate = _emulate_avg(op, group)
    work = _reduce_like("reduce", lambda **kw: dist.reduce(tensor, dst, **kw), tensor,
                        ReduceOp.SUM if emulate else op, group, async_op)
    if not emulate or dist.get_rank() != dst:
        return work
    if async_op:
        return _DivideAfter(work, tensor, dist.get_world_size(group))
    _divide(tensor, dist.get_world_size(group))
    return None


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False):
    """In place: every rank's `tensor` becomes global rank `src`'s."""
    _require_init("broadcast")
    with record_function("zerospeed::broadcast"):
        return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False):
    """`tensor_list[r]` (one tensor per group rank, each shaped as `tensor`) receives group rank r's `tensor`."""
    _require_init("all_gather")
    with record_function("zerospeed::all_gather"):
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor,
                           group: dist.ProcessGroup | None = None, async_op: bool = False):
    """`output_tensor` ([N * k, ...], N = group size) receives every rank's `tensor` ([k, ...]) in rank order."""
    _require_init("all_gather_into_tensor")
    with record_function("zerospeed::all_gather"):
        return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None, async_op: bool = False):
    """`output` on group rank r becomes the `op`-reduction of every rank's `input_list[r]`."""
    return _reduce_like("reduce_scatter", lambda **kw: dist.reduce_scatter(output, input_list, **kw), output, op,
                        group, async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False):
    """`tensor` ([N * k, ...]) is reduced over `group`; group rank r receives rows [r*k, (r+1)*k) in
    `output_tensor` ([k, ...])."""
    return _reduce_like("reduce_scatter_tensor",
                        lambda **kw: dist.reduce_scatter_tensor(output_tensor, tensor, **kw), output_tensor, op,
                        group, async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: dist.ProcessGroup | None = None,
                      async_op: bool = False):
    """Split `tensor` along dim 0 (equally, or by `input_split_sizes`) and send piece j to group rank j;
    `output` receives the pieces from every rank in rank order."""
    _require_init("all_to_all_single")
    with record_function("zerospeed::all_to_all"):
        return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                      input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: dist.ProcessGroup | None = None, async_op: bool = False):
    """`input_tensor_list[j]` goes to group rank j; `output_tensor_list[i]` receives group rank i's piece."""
    _require_init("all_to_all")
    with record_function("zerospeed::all_to_all"):
        return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: dist.ProcessGroup | None = None, async_op: bool = False):
    """Global rank `dst` receives every rank's `tensor` in `gather_list` (None on the other ranks)."""
    _require_init("gather")
    with record_function("zerospeed::gather"):
        return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: dist.ProcessGroup | None = None, async_op: bool = False):
    """Group rank r's `tensor` receives global rank `src`'s `scatter_list[r]`."""
    _require_init("scatter")
    with record_function("zerospeed::scatter"):
        return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> None:
    """Blocking send of `tensor` to global rank `dst`."""
    _require_init("send")
    with record_function("zerospeed::send"):
        dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None, tag: int = 0) -> int:
    """Blocking receive into `tensor` from global rank `src` (None: any rank); returns the sender's rank."""
    _require_init("recv")
    with record_function("zerospeed::recv"):
        return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0):
    """Start sending `tensor` to global rank `dst`; returns a `Work` (`.wait()` before reusing `tensor`)."""
    _require_init("isend")
    with record_function("zerospeed::isend"):
        return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None, tag: int = 0):
    """Start receiving into `tensor` from global rank `src`; returns a `Work` (`.wait()` before reading)."""
    _require_init("irecv")
    with record_function("zerospeed::irecv"):
        return dist.irecv(tensor, src, group=group, tag=tag)
