"""DeepSpeed's ZeRO-3 markers on a parameter, for user scripts that test them (`ds_id`, `ds_status`, `ds_numel`,
`ds_shape`, `ds_tensor`; DeepSpeed-Chat's `_z3_params_to_fetch`, parameter counts `p.ds_numel if hasattr(p,
"ds_tensor") else p.numel()`).

The state itself stays beside the parameter (`stage3_params.ShardedParam`, `stage3_init_shards.InitShard`);
these attributes mirror it: `ds_status` is `ZeroParamStatus.NOT_AVAILABLE` while only a shard exists,
`INFLIGHT` during its all-gather, `AVAILABLE` while the parameter holds its full value (inside a forward, a
`GatheredParameters` block, or before `zero.Init` partitions it).
"""
from __future__ import annotations

import enum
import itertools

import torch


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's `deepspeed.runtime.zero.partition_parameters.ZeroParamStatus` (same names and values)."""

    AVAILABLE = 1  # the full value is in `param.data`
    NOT_AVAILABLE = 2  # partitioned: `param.data` is a 0-element placeholder
    INFLIGHT = 3  # an all-gather of it is under way


_IDS = itertools.count()


def mark(param: torch.Tensor, shape: torch.Size, status: ZeroParamStatus, partition: torch.Tensor | None = None) -> None:
    """Give `param` DeepSpeed's markers: a process-unique `ds_id` (kept if it has one), its full `ds_shape` and
    `ds_numel` (elements), `ds_status`, and - if given - `ds_tensor`, this rank's part of it (1-D; 0 elements
    where this rank holds none of it or the part is on NVMe)."""
    if not hasattr(param, "ds_id"):
        param.ds_id = next(_IDS)
    param.ds_shape = torch.Size(shape)
    param.ds_numel = param.ds_shape.numel()
    param.ds_status = status
    if partition is not None:
        param.ds_tensor = partition
