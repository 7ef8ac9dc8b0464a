"""Pick and build the ZeRO strategy for a stage: the one place that maps `stage` to a class."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import GroupCollectives
from ..comm.logger import CommsLogger
from ..precision import MixedPrecisionPolicy
from .strategy import DataParallelStrategy, ZeroStrategy


def build_strategy(stage: int, *, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   group: dist.ProcessGroup | None, zero_cfg, gradient_allreduce_op: str = "mean",
                   predivide_factor: float = 1.0, logger: CommsLogger | None = None,
                   policy: MixedPrecisionPolicy | None = None,
                   master_values: dict[int, torch.Tensor] | None = None, offload=None,
                   model_parallel=None, collectives: type[GroupCollectives] = GroupCollectives,
                   experts=None) -> ZeroStrategy:
    """The strategy for ZeRO `stage` (0-3) over `module`'s trainable parameters.

    optimizer: the user's optimizer over the module's trainable parameters, in the user's param groups
    (None: no optimizer); the strategy re-targets it to what this rank updates (`param_groups.py`).
    group: the data-parallel process group (the mesh's "data" group; None = the world).
    zero_cfg: the validated `zero_optimization` section (bucket sizes in elements, stage-3 knobs).
    policy: the mixed-precision policy (default fp32); the module must already be cast to
    `policy.param_dtype`. master_values: {id(param): original fp32 value} from
    `MixedPrecisionPolicy.cast_module`, so the fp32 masters lose nothing at init. offload: an
    `offload.OffloadContext` (stages >= 1; ZeRO-Offload / ZeRO-Infinity) or None. model_parallel: a
    `clipping.ModelParallelGrads` when tensor parallelism splits the gradient (the global norm then sums
    over its group too), else None. collectives: the `comm.collectives.GroupCollectives` class (or a
    subclass: a quantized or compressed implementation) the strategy's reducers and all-gathers call,
    instantiated as `collectives(group, logger)`. experts: a `strategy.ExpertGroup` (mixture of experts with
    expert parallelism: those parameters are reduced over the expert-data group; stages 1-2 partition them
    over it, `stage12_grouped.py`), or None; NotImplementedError at stage 3.
    Raises NotImplementedError for a stage this version does not implement.
    """
    policy = policy or MixedPrecisionPolicy()
    params = [p for p in module.parameters() if p.requires_grad]
    bucket = int(zero_cfg.reduce_bucket_elements)  # unset: DDP's 25 MiB buckets (config/zero.py)
    common = dict(group=group, average=gradient_allreduce_op == "mean", predivide_factor=predivide_factor,
                  logger=logger, policy=policy, master_values=master_values, collectives=collectives)
    if stage == 0:
        names = {id(p): n for n, p in module.named_parameters()}
        strategy: ZeroStrategy = DataParallelStrategy(params, optimizer, bucket_size=bucket,
                                                      names=[names[id(p)] for p in params], experts=experts,
                                                      **common)
    elif experts is not None and stage in (1, 2):
        from .stage12_grouped import GroupedStage12Strategy

        strategy = GroupedStage12Strategy(
            module, params, optimizer, stage=stage, sets=[experts],
            reduce_bucket_size=bucket, allgather_bucket_size=int(zero_cfg.allgather_bucket_size),
            reduce_scatter=zero_cfg.reduce_scatter, allgather_partitions=zero_cfg.allgather_partitions,
            offload=offload, **common)
    elif experts is not None:
        raise NotImplementedError(f"zero_optimization.stage={stage} with expert parallelism (an MoE layer with "
                                  "ep_size > 1) is not supported (DeepSpeed 0.19.8 refuses MoE at stage 3 too): use "
                                  "stage 1 or 2 (the experts' states are partitioned over the expert-data group), or "
                                  "ep_size=1")
    elif stage in (1, 2):
        from .stage12 import Stage12Strategy

        strategy = Stage12Strategy(module, params, optimizer, stage=stage, reduce_bucket_size=bucket,
                                   allgather_bucket_size=int(zero_cfg.allgather_bucket_size),
                                   reduce_scatter=zero_cfg.reduce_scatter,
                                   allgather_partitions=zero_cfg.allgather_partitions, offload=offload, **common)
    elif stage == 3:
        from .stage3 import Stage3Strategy

        strategy = Stage3Strategy.from_config(module, optimizer, zero_cfg=zero_cfg, offload=offload, **common)
    else:
        raise NotImplementedError(f"zero_optimization.stage={stage} is not implemented yet in this version of "
                                  "zerospeed; use stage 0 (data parallelism) for now")
    strategy.model_parallel = model_parallel
    return strategy
