"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): column/row-parallel linear layers over plain
local shards, sharding plans as data (DeepSpeed's `partition_config`, presets, HF `base_model_tp_plan`),
AutoTP, which applies a plan to an unmodified model, and `describe_plan`, which prints one."""
from .autotp import apply_tensor_parallel, check_divisible
from .describe import describe_plan
from .layers import (ColumnParallelLinear, RowParallelLinear, ShardSpec, shard_tensor, tensor_parallel_layers,
                     unshard_tensors)
from .plan import PRESETS, TPPlan, TPRule, plan_for_model, plan_from_config

__all__ = ["apply_tensor_parallel", "check_divisible", "describe_plan", "ColumnParallelLinear", "RowParallelLinear",
           "ShardSpec", "shard_tensor", "tensor_parallel_layers", "unshard_tensors", "PRESETS", "TPPlan", "TPRule",
           "plan_for_model", "plan_from_config"]
