"""Mixture of experts (`zerospeed.moe`), DeepSpeed's `deepspeed.moe` API: `from zerospeed.moe.layer import MoE`.

Modules, at DeepSpeed's paths: `layer` (MoE), `sharded_moe` (top1gating / top2gating / topkgating,
TopKGate, MOELayer), `experts` (Experts), `utils` (is_moe_param,
split_params_into_different_moe_groups_for_optimizer, ...); `routing` holds the routing rules, `dropless`
the dropless expert computation (`drop_tokens=False`), `autoep` AutoEP's expert-parallel replacement of a
Hugging Face model's fused experts (`"expert_parallel"` in the config). Expert parallelism (ep_size > 1) is
set up by `zerospeed.initialize` (`runtime/moe_setup.py`) or `MoE.set_deepspeed_parallelism()`.
"""
from .experts import Experts
from .layer import MoE
from .sharded_moe import MOELayer, TopKGate, top1gating, top2gating, topkgating
from .utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["Experts", "MoE", "MOELayer", "TopKGate", "top1gating", "top2gating", "topkgating", "is_moe_param",
           "split_params_into_different_moe_groups_for_optimizer"]
