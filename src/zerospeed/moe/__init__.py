"""Mixture of experts (`zerospeed.moe`), DeepSpeed's `deepspeed.moe` API: `from zerospeed.moe.layer import MoE`.

Modules, at DeepSpeed's paths: `layer` (MoE), `sharded_moe` (top1gating / top2gating / topkgating,
TopKGate, MOELayer), `experts` (Experts), `utils` (is_moe_param,
split_params_into_different_moe_groups_for_optimizer, ...); `routing` holds the routing rules.
This version runs with one expert-parallel rank (ep_size=1); expert parallelism comes with the engine
integration.
"""
from .experts import Experts
from .layer import MoE
from .sharded_moe import MOELayer, TopKGate, top1gating, top2gating, topkgating
from .utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["Experts", "MoE", "MOELayer", "TopKGate", "top1gating", "top2gating", "topkgating", "is_moe_param",
           "split_params_into_different_moe_groups_for_optimizer"]
