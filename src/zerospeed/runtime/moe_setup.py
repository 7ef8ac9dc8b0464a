"""Mixture of experts inside `zerospeed.initialize`: the expert-parallel size of the model's MoE layers
(checked before any process group exists), their expert groups from the mesh, and how the strategy reduces
and norms the expert gradients.

With ep_size > 1 each rank of a mesh "expert" group (ep consecutive data-parallel ranks) holds different
experts, so (DeepSpeed-MoE, Rajbhandari et al. 2022 §4):

* expert parameters start equal over "expert_data" (the ranks holding the same experts), not the world;
* their gradients are summed over "expert_data" and divided by the data-parallel size (`ExpertGroup`);
* the global gradient norm sums the experts' squares over "expert" too, the dense parameters (identical on
  every rank of it) counted once (`ModelParallelGrads` over the "expert" group, dense = replicated).
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..config import ConfigError

__all__ = ["moe_layers", "expert_parallel_size", "expert_param_ids", "attach_expert_groups", "expert_group",
           "expert_model_parallel_grads"]


def moe_layers(model: nn.Module) -> list:
    """The model's `zerospeed.moe.sharded_moe.MOELayer`s (the inner layer of every `MoE`)."""
    from ..moe.sharded_moe import MOELayer

    return [m for m in model.modules() if isinstance(m, MOELayer)]


def expert_parallel_size(cfg, model: nn.Module, mpu, pipeline: bool) -> int:
    """The ep_size shared by the model's MoE layers with ep_size > 1, or 1. Pure (no process group): raises
    ConfigError when layers differ in ep_size, NotImplementedError for what expert parallelism does not
    compose with yet (a pipeline, tensor parallelism, a user's mpu, ZeRO stages >= 1)."""
    sizes = sorted({layer.ep_size for layer in moe_layers(model) if layer.ep_size > 1})
    if not sizes:
        return 1
    if len(sizes) > 1:
        raise ConfigError(f"the model's MoE layers use different ep_size values {sizes}: zerospeed builds one "
                          "expert-parallel mesh dimension, so give every MoE layer the same ep_size")
    ep = sizes[0]
    blockers = [what for what, on in (("a PipelineModule", pipeline), ("tensor parallelism (tensor_parallel."
                                      "autotp_size > 1)", cfg.tensor_parallel.size > 1), ("initialize(mpu=...)",
                                      mpu is not None)) if on]
    if blockers:
        raise NotImplementedError(f"MoE layers with ep_size={ep} together with {blockers[0]} are not supported yet: "
                                  "use ep_size=1 there (every expert on every rank)")
    if cfg.zero_optimization.stage > 0:
        raise NotImplementedError(f"MoE layers with ep_size={ep} at zero_optimization.stage="
                                  f"{cfg.zero_optimization.stage} are not supported yet (expert parameters must be "
                                  "partitioned over the expert-data group): use stage 0, or ep_size=1")
    return ep


def expert_param_ids(model: nn.Module) -> frozenset:
    """id()s of the parameters of the experts of every MoE layer with ep_size > 1."""
    return frozenset(id(p) for layer in moe_layers(model) if layer.ep_size > 1 for p in layer.experts.parameters())


def _group(mesh, name: str):
    """The mesh's `name` group as a real process group: the world when it spans it (the mesh says None), a
    one-rank group of this rank when its size is 1 (collective over the world: it creates the groups)."""
    group = mesh.group(name)
    if group is not None:
        return group
    if mesh.size(name) > 1:
        return dist.group.WORLD
    return dist.new_subgroups(group_size=1)[0]


def attach_expert_groups(model: nn.Module, mesh, logger=None) -> None:
    """Give every MoE layer with ep_size > 1 the mesh's "expert" group (its all-to-alls and dropless capacity)
    and the comms logger (its all-to-alls are counted with the other collectives)."""
    for layer in moe_layers(model):
        layer.logger = logger
        if layer.ep_size > 1:
            layer._set_ep_group(_group(mesh, "expert"))


def expert_group(model: nn.Module, mesh):
    """The `zero.strategy.ExpertGroup` of the experts (reduced over "expert_data", averaged over "data"), or
    None without expert parallelism."""
    from ..zero.strategy import ExpertGroup

    if mesh.size("expert") == 1:
        return None
    return ExpertGroup(params=expert_param_ids(model), group=_group(mesh, "expert_data"),
                       average_over=mesh.size("data"))


def expert_model_parallel_grads(model: nn.Module, mesh):
    """`ModelParallelGrads` over the "expert" group: expert gradients are disjoint across it, the others
    replicated (counted once). None without expert parallelism."""
    from ..zero.clipping import ModelParallelGrads

    if mesh.size("expert") == 1:
        return None
    experts = expert_param_ids(model)
    return ModelParallelGrads(group=_group(mesh, "expert"), size=mesh.size("expert"),
                              replicated=frozenset(id(p) for p in model.parameters() if id(p) not in experts))
