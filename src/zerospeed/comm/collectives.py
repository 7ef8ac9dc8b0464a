"""The collectives the ZeRO stages run, over one process group: the seam for other implementations.

The reducers (stage 0's all-reduce, stages 1-2's and stage 3's reduce-scatter) and the parameter
all-gathers (stages 1-2 after the step, stage 3's units) call a `GroupCollectives` object instead of
`comm.ops` with a (group, logger) pair, as FSDP2 takes its `AllGather` / `ReduceScatter` `Comm`
objects (torch.distributed.fsdp._fully_shard._fsdp_api): a quantized (ZeRO++: qwZ all-gather, qgZ
reduce-scatter, Wang et al. 2023) or compressed implementation subclasses it, overrides the three
`start_*` methods, and is handed to the strategy; the stages stay as they are.

Contract of every `start_*` method (what a replacement must keep): it starts the collective and
returns a handle with `wait()` (idempotent; the result is valid after it) and `is_completed()`
(never blocks), as `comm.ops.CommHandle`; all ranks of `group` call the same methods in the same
order with the same sizes; the call runs inside `record_function("zerospeed::<op>")` and is counted
by `logger` (this class gets both from `comm.ops`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import ops
from .logger import CommsLogger


@dataclass(frozen=True)
class GroupCollectives:
    """The plain (uncompressed) collectives over `group` (None: the default group), counted by `logger`.

    `world_size` and `rank` are taken in `group` (`dist.get_rank(group)`, not the global rank).
    """

    group: dist.ProcessGroup | None = None
    logger: CommsLogger | None = None

    @property
    def world_size(self) -> int:
        """Ranks in `group`."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This process's rank in `group` (0 <= rank < world_size)."""
        return dist.get_rank(self.group)

    def start_all_reduce(self, tensor: torch.Tensor) -> ops.CommHandle:
        """In-place SUM all-reduce of `tensor` (any shape) over the group (`comm.ops.start_all_reduce`)."""
        return ops.start_all_reduce(tensor, group=self.group, logger=self.logger)

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                             input_is_scratch: bool = False,
                             workspace: torch.Tensor | None = None) -> ops.CommHandle:
        """SUM reduce-scatter: `input` [N * k] summed over the group, rank r receiving elements
        [r*k, (r+1)*k) in `output` [k] (may be that slice of `input`). input_is_scratch: the caller no
        longer needs `input`; workspace: a buffer of >= (N-1)k elements it may receive into
        (`comm.ops.start_reduce_scatter`, which says what both allow on gloo)."""
        return ops.start_reduce_scatter(output, input, group=self.group, logger=self.logger,
                                        input_is_scratch=input_is_scratch, workspace=workspace)

    def reduce_scatter_workspace_numel(self, k: int) -> int:
        """Elements of the `workspace` `start_reduce_scatter` (scratch input, output of `k` elements) can
        receive into on this group's backend: (N-1)k on gloo, 0 otherwise."""
        return ops.reduce_scatter_workspace_numel(k, group=self.group)

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> ops.CommHandle:
        """All-gather: every rank's `input` [k] lands in `output` [N * k] at [r*k, (r+1)*k); `input` may
        be this rank's slice of `output` (`comm.ops.start_all_gather`)."""
        return ops.start_all_gather(output, input, group=self.group, logger=self.logger)
