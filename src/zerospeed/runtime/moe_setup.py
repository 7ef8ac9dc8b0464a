"""Mixture of experts inside `zerospeed.initialize`: the expert-parallel size of the model's MoE layers
(checked before any process group exists), their expert groups from the mesh, and how the strategy reduces
and norms the expert gradients.

With ep_size > 1 each rank of a mesh "expert" group (ep consecutive data-parallel ranks) holds different
experts, so (DeepSpeed-MoE, Rajbhandari et al. 2022 §4):

* expert parameters start equal over "expert_data" (the ranks holding the same experts), not the world;
* their gradients are summed over "expert_data" and divided by the data-parallel size (`ExpertGroup`);
* the global gradient norm: every element has one owner over "data" (stage 0: each rank's writer slice of
  the replicated gradients, the experts cut over "expert_data"; stages 1-2: the partitions, the experts
  partitioned over "expert_data", `zero.stage12_grouped`), so the owned squares are summed over "data";
  with tensor parallelism the experts (replicated over "tensor") count once, as the other replicated
  parameters (`ModelParallelGrads`).

With tensor parallelism (AutoTP) the expert groups are carved from each tensor rank's data group, so the
ranks of a tensor group run the same tokens through the same experts (replicated, not sharded).
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..config import ConfigError

__all__ = ["moe_layers", "expert_parallel_size", "expert_param_ids", "attach_expert_groups", "expert_group",
           "autoep_blocks", "apply_autoep", "expert_comm_group", "agree_across_stages"]


def moe_layers(model: nn.Module) -> list:
    """The model's expert-holding layers: `zerospeed.moe.sharded_moe.MOELayer`s (the inner layer of every `MoE`)
    and AutoEP's `moe.autoep.ExpertParallelExperts`."""
    from ..moe.autoep import ExpertParallelExperts
    from ..moe.sharded_moe import MOELayer

    return [m for m in model.modules() if isinstance(m, (MOELayer, ExpertParallelExperts))]


def _expert_params(layer):
    return layer.expert_parameters() if hasattr(layer, "expert_parameters") else layer.experts.parameters()


def autoep_blocks(cfg, model: nn.Module) -> list:
    """AutoEP (`expert_parallel.enabled`): the model's MoE blocks (`moe.autoep.find_moe_blocks` with the config's
    patterns), checked against the config before any process group: raises ConfigError for no block found
    (naming the MoE-like module types seen and the keys to set), a preset_model that is not the model's type,
    a top_k other than the model's, num_experts not divisible by autoep_size. [] when AutoEP is off."""
    from ..config.expert_parallel import PRESET_MODELS
    from ..moe.autoep import find_moe_blocks, fused_experts_problem

    ep_cfg = cfg.expert_parallel
    if not ep_cfg.enabled:
        return []
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if ep_cfg.preset_model is not None and model_type not in PRESET_MODELS[ep_cfg.preset_model]:
        raise ConfigError(f"expert_parallel.preset_model={ep_cfg.preset_model!r} is for model type(s) "
                          f"{list(PRESET_MODELS[ep_cfg.preset_model])}, but the model's config.model_type is "
                          f"{model_type!r}; remove preset_model (the MoE blocks are detected) or fix it")
    try:
        blocks = find_moe_blocks(model, moe_layer_pattern=ep_cfg.moe_layer_pattern,
                                 expert_pattern=ep_cfg.expert_pattern, router_pattern=ep_cfg.router_pattern)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not blocks:
        seen = sorted({type(m).__name__ for m in model.modules()
                       if any(w in type(m).__name__.lower() for w in ("moe", "expert", "router"))})
        why = sorted({f"{type(m).__name__}: {fused_experts_problem(m)}" for m in model.modules()
                      if "expert" in type(m).__name__.lower()})
        raise ConfigError(f"expert_parallel.enabled but no MoE block with transformers' fused experts (3-D "
                          f"gate_up_proj / down_proj, called with top_k_index and top_k_weights) was found in "
                          f"{type(model).__name__}; MoE-like module types seen: {seen or 'none'}"
                          f"{' (' + '; '.join(why) + ')' if why else ''}. Set expert_parallel.moe_layer_pattern "
                          "(regex over block names), expert_pattern and router_pattern (child names), or disable it")
    k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if ep_cfg.top_k != "auto" and ep_cfg.top_k != k:
        raise ConfigError(f"expert_parallel.top_k={ep_cfg.top_k} but the model routes to {k} experts per token "
                          "(config.num_experts_per_tok); AutoEP keeps the model's own router: remove top_k")
    for b in blocks:
        if b.num_experts % ep_cfg.autoep_size:
            raise ConfigError(f"expert_parallel.autoep_size={ep_cfg.autoep_size} does not divide the "
                              f"{b.num_experts} experts of {b.name}; use a divisor of {b.num_experts}")
    return blocks


def apply_autoep(blocks: list, ep_size: int, ep_rank: int) -> dict:
    """Replace each block's experts module by this rank's `ExpertParallelExperts` (rows ep_rank x E/ep_size ..
    of its weights, which every rank must already hold equal). Returns {id(full parameter): local parameter}
    for re-pointing a client optimizer (`tp_setup.remap_parameters`)."""
    from ..moe.autoep import ExpertParallelExperts

    mapping = {}
    for b in blocks:
        full = b.experts
        local = ExpertParallelExperts.from_full(full, ep_size, ep_rank)
        mapping[id(full.gate_up_proj)] = local.gate_up_proj
        mapping[id(full.down_proj)] = local.down_proj
        setattr(b.block, b.experts_name, local)
    return mapping


def expert_parallel_size(cfg, model: nn.Module) -> int:
    """The ep_size shared by the model's MoE layers with ep_size > 1 and AutoEP's autoep_size, or 1. Pure (no
    process group): raises ConfigError when they differ, NotImplementedError for what expert parallelism does
    not compose with (ZeRO stage 3). With a user's mpu the expert groups are carved from its data-parallel
    groups (`ParallelMesh.from_mpu(mpu, ep)`)."""
    sizes = sorted({layer.ep_size for layer in moe_layers(model) if layer.ep_size > 1} |
                   ({cfg.expert_parallel.size} if cfg.expert_parallel.size > 1 else set()))
    if not sizes:
        return 1
    if len(sizes) > 1:
        raise ConfigError(f"the model's MoE layers (and expert_parallel.autoep_size) use different ep_size values "
                          f"{sizes}: zerospeed builds one expert-parallel mesh dimension, so give every MoE layer "
                          "the same ep_size")
    ep = sizes[0]
    if cfg.zero_optimization.stage == 3:
        raise NotImplementedError(f"MoE layers with ep_size={ep} at zero_optimization.stage=3 are not supported "
                                  "(DeepSpeed 0.19.8 refuses MoE at stage 3 too): use stage 1 or 2, whose expert "
                                  "optimizer states and gradients are partitioned over the expert-data group, or ep_size=1")
    return ep


def agree_across_stages(ep: int) -> int:
    """The expert-parallel size of a pipeline: each stage built only its own layers, so a stage without MoE
    layers sees 1; every rank takes the size the others found (an all-gather over the world). Raises
    ConfigError when two stages found different sizes > 1."""
    sizes: list = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, ep)
    found = sorted({s for s in sizes if s > 1})
    if len(found) > 1:
        raise ConfigError(f"the pipeline stages' MoE layers use different ep_size values {found}: zerospeed builds one "
                          "expert-parallel mesh dimension, so give every MoE layer the same ep_size")
    return found[0] if found else 1


def expert_param_ids(model: nn.Module) -> frozenset:
    """id()s of the parameters of the experts of every MoE layer with ep_size > 1."""
    return frozenset(id(p) for layer in moe_layers(model) if layer.ep_size > 1 for p in _expert_params(layer))


def _group(mesh, name: str):
    """The mesh's `name` group as a real process group: the world when it spans it (the mesh says None), a
    one-rank group of this rank when its size is 1 (collective over the world: it creates the groups)."""
    group = mesh.group(name)
    if group is not None:
        return group
    if mesh.size(name) > 1:
        return dist.group.WORLD
    return dist.new_subgroups(group_size=1)[0]


def expert_comm_group(mesh):
    """The process group of the MoE all-to-alls: the ranks of the mesh's "expert" group, in a group of their own.
    When ep equals the data-parallel size the mesh's "expert" group *is* the data group, and a process group runs
    its collectives in order (gloo, NCCL): a backward all-to-all would queue behind the gradient buckets in
    flight on it (measured on the small GPT-MoE at ep 2 = world 2, fp32: 0.25 s of all-to-all per step against
    DeepSpeed's 0.17, which reduces after backward). Collective over the world (it creates the groups); call once."""
    from ..parallel.topology import expert_rank_lists

    if mesh.size("expert") != mesh.size("data") or mesh.topology is None:
        return _group(mesh, "expert")
    return dist.new_subgroups_by_enumeration(expert_rank_lists(mesh.topology, mesh.size("expert"))[0])[0]


def attach_expert_groups(model: nn.Module, group, logger=None) -> None:
    """Give every MoE layer with ep_size > 1 the expert-parallel process `group` (`expert_comm_group`: its
    all-to-alls and dropless capacity) and the comms logger (its all-to-alls are counted with the others)."""
    for layer in moe_layers(model):
        layer.logger = logger
        if layer.ep_size > 1:
            layer._set_ep_group(group)


def expert_group(model: nn.Module, mesh):
    """The `zero.strategy.ExpertGroup` of the experts (reduced over "expert_data", averaged over "data"), or
    None without expert parallelism."""
    from ..zero.strategy import ExpertGroup

    if mesh.size("expert") == 1:
        return None
    return ExpertGroup(params=expert_param_ids(model), group=_group(mesh, "expert_data"),
                       average_over=mesh.size("data"))
