"""Process groups and collectives (`zerospeed.comm`).

At package level, DeepSpeed's `deepspeed.comm` API (`comm.py`): `import zerospeed.comm as dist`, then
`dist.get_rank()`, `dist.all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False)`, ... Internal
code uses the profiled, counted start/finish collectives of `zerospeed.comm.ops` (import them from there).
"""
from .comm import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    destroy_process_group,
    gather,
    get_all_ranks_from_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    inference_all_reduce,
    irecv,
    is_available,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from .init import LaunchEnv, default_backend, default_device, init_distributed, read_launch_env
from .logger import CommsLogger, OpStats
from .ops import CommHandle, start_all_reduce
from .summary import log_summary, reset_log

__all__ = [
    # DeepSpeed's deepspeed.comm
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all", "all_to_all_single", "barrier",
    "broadcast", "destroy_process_group", "gather", "get_all_ranks_from_group", "get_global_rank", "get_local_rank",
    "get_rank", "get_world_group", "get_world_size", "inference_all_reduce", "init_distributed", "irecv",
    "is_available", "is_initialized", "isend", "new_group", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "send", "log_summary", "reset_log",
    # zerospeed's own
    "CommHandle", "CommsLogger", "LaunchEnv", "OpStats", "default_backend", "default_device", "read_launch_env",
    "start_all_reduce",
]
