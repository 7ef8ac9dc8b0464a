"""Pick and build the ZeRO strategy for a stage: the one place that maps `stage` to a class."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.logger import CommsLogger
from ..precision import MixedPrecisionPolicy
from .strategy import DataParallelStrategy, ZeroStrategy

def build_strategy(stage: int, *, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   group: dist.ProcessGroup | None, zero_cfg, gradient_allreduce_op: str = "mean",
                   predivide_factor: float = 1.0, logger: CommsLogger | None = None,
                   policy: MixedPrecisionPolicy | None = None,
                   master_values: dict[int, torch.Tensor] | None = None, offload=None,
                   model_parallel=None) -> ZeroStrategy:
    """The strategy for ZeRO `stage` (0-3) over `module`'s trainable parameters.

    optimizer: the user's optimizer over the module's trainable parameters, in the user's param groups
    (None: no optimizer); the strategy re-targets it to what this rank updates (`param_groups.py`).
    zero_cfg: the validated `zero_optimization` section (bucket sizes in elements, stage-3 knobs).
    policy: the mixed-precision policy (default fp32); the module must already be cast to
    `policy.param_dtype`. master_values: {id(param): original fp32 value} from
    `MixedPrecisionPolicy.cast_module`, so the fp32 masters lose nothing at init. model_parallel: a
    `clipping.ModelParallelGrads` when tensor parallelism splits the gradient (the global norm then sums
    over its group too), else None. offload: an
    `offload.OffloadContext` (stages >= 1; ZeRO-Offload / ZeRO-Infinity) or None.
    Raises NotImplementedError for a stage this version does not implement.
    """
    strategy = _construct(stage, module=module, optimizer=optimizer, group=group, zero_cfg=zero_cfg,
                          gradient_allreduce_op=gradient_allreduce_op, predivide_factor=predivide_factor,
                          logger=logger, policy=policy, master_values=master_values, offload=offload)
    strategy.model_parallel = model_parallel
    return strategy


def _construct(stage: int, *, module, optimizer, group, zero_cfg, gradient_allreduce_op, predivide_factor, logger,
               policy, master_values, offload) -> ZeroStrategy:
    policy = policy or MixedPrecisionPolicy()
    params = [p for p in module.parameters() if p.requires_grad]
    bucket = int(zero_cfg.reduce_bucket_elements)  # unset: DDP's 25 MiB buckets (config/zero.py)
    if stage == 0:
        names = {id(p): n for n, p in module.named_parameters()}
        return DataParallelStrategy(params, optimizer, group=group, bucket_size=bucket,
                                    average=gradient_allreduce_op == "mean", predivide_factor=predivide_factor,
                                    logger=logger, policy=policy, names=[names[id(p)] for p in params],
                                    master_values=master_values)
    if stage in (1, 2):
        from .stage12 import Stage12Strategy

        return Stage12Strategy(module, params, optimizer, stage=stage, group=group,
                               reduce_bucket_size=bucket,
                               allgather_bucket_size=int(zero_cfg.allgather_bucket_size),
                               reduce_scatter=zero_cfg.reduce_scatter, allgather_partitions=zero_cfg.allgather_partitions,
                               average=gradient_allreduce_op == "mean", predivide_factor=predivide_factor,
                               logger=logger, policy=policy, master_values=master_values, offload=offload)
    if stage == 3:
        from .stage3 import Stage3Strategy

        return Stage3Strategy.from_config(module, optimizer, group=group, zero_cfg=zero_cfg,
                                          average=gradient_allreduce_op == "mean",
                                          predivide_factor=predivide_factor, logger=logger, policy=policy,
                                          master_values=master_values, offload=offload)
    raise NotImplementedError(f"zero_optimization.stage={stage} is not implemented yet in this version of "
                              "zerospeed; use stage 0 (data parallelism) for now")
