"""Parallel layouts: the rank topology and the device mesh whose named sub-groups every strategy takes.

`ProcessTopology` / `PipeModelDataParallelTopology` map ranks to (pipe, data, model) coordinates as
DeepSpeed's; `ParallelMesh.build(tp=, pp=, ep=)` builds the DeviceMesh and its "data", "tensor", "pipe" and
"model" groups, plus "expert" / "expert_data" carved from data (`expert_rank_lists`), and doubles as a
Megatron-style `mpu` for `zerospeed.initialize(mpu=...)`.
"""
from .mesh import MpuError, ParallelDims, ParallelMesh
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology, expert_rank_lists

__all__ = ["MpuError", "ParallelDims", "ParallelMesh", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "ProcessTopology", "expert_rank_lists"]
