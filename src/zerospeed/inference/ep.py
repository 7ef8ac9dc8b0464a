"""Expert-parallel serving: `init_inference(model, moe={"ep_size": N})` (DeepSpeed's `moe` block; the deprecated
top-level `ep_size=N` is remapped).

The experts of every MoE layer are spread over an "expert" group of N ranks (consecutive ranks, as DeepSpeed's
`InferenceEngine._create_ep_parallel_group`; the other world / N groups serve replicas), each rank holding E / N
experts, and the tokens are exchanged with all-to-all - the training path's layers, unchanged
(DeepSpeed-MoE, Rajbhandari et al. 2022 §5: expert parallelism for inference):

* an unmodified Hugging Face MoE model (Mixtral, Qwen3-MoE, DeepSeek-V2/V3: transformers' fused experts) gets
  AutoEP's `moe.autoep.ExpertParallelExperts` in place of each block's experts: this rank's rows of the fused
  weights, run dropless on exactly the tokens routed to them, so the outputs equal the unmodified model's;
  the router, attention and shared experts stay whole on every rank. The ranks must hold the same full
  weights (checked), or the model is built on the meta device and `checkpoint` gives each rank its rows only;
* a model of `zerospeed.moe.layer.MoE` layers built with `ep_size=N` already holds its own experts: it gets the
  expert group (without it its forward raises). Its capacity at eval is `eval_capacity_factor`, as in training.

The ranks of an expert group must run the same number of forwards (each is collective); their batches may
differ. With tensor parallelism (`tensor_parallel.tp_size`, world = tp x ep x replicas) the expert groups are
carved from the data-parallel ranks as in training (`ParallelMesh.build(tp=, ep=)`): the ranks of one tensor
group hold the same experts and run the same tokens (the attention's all-reduce made them equal), each
exchanging with its peers of the same tensor coordinate in the other tensor groups.

DeepSpeed 0.19.8 creates the groups but gives them only to its CUDA-only injected MoE kernels.
With kernel injection the decode step is compiled around the experts: their dispatch (data-dependent token
counts) runs eagerly between the compiled parts (`dropless_experts` is excluded from compilation).

`save_mp_checkpoint_path` writes each expert rank's rows to a file of their own (`inference/mp_checkpoint.py`).

Not combined yet (ValueError naming them): ZeRO-Inference,
`moe.ep_mp_group` (expert tensor parallelism), a user's tp_group / mpu without `moe.ep_group`.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .tp import TPGroup

__all__ = ["ExpertPlan", "expert_plan", "expert_mesh", "expert_group", "shard_experts"]


class ExpertPlan:
    """What `shard_experts` will do: `size` (the expert-parallel size, 1 = none), `blocks` (HF MoE blocks to split,
    `moe.autoep.MoEBlock`s) and `layers` (the model's `MoE` layers with ep_size > 1)."""

    def __init__(self, size: int, blocks: list, layers: list):
        self.size, self.blocks, self.layers = size, blocks, layers


def expert_plan(model: nn.Module, config) -> ExpertPlan:
    """The expert-parallel plan of `model` under the inference `config`; pure (no process group), so bad input
    fails before any weight changes. ep is `moe.ep_size`, or the `ep_size` the model's own `MoE` layers were
    built with when the config leaves it at 1. Raises ValueError for a model without an MoE layer to split
    (naming what was looked for), an ep that does not divide a block's experts or differs from the layers' own,
    and for options it does not combine with yet."""
    from ..moe.autoep import find_moe_blocks
    from ..moe.sharded_moe import MOELayer

    moe = config.moe
    layers = [m for m in model.modules() if isinstance(m, MOELayer) and m.ep_size > 1]
    built = sorted({m.ep_size for m in layers})
    ep = moe.ep_size if moe.enabled else 1
    if len(built) > 1:
        raise ValueError(f"the model's MoE layers were built with different ep_size values {built}; expert-parallel "
                         "serving uses one expert group: build every MoE layer with the same ep_size")
    if built and ep not in (1, built[0]):
        raise ValueError(f"moe.ep_size={ep} but the model's MoE layers were built with ep_size={built[0]} (each rank "
                         f"holds num_experts / {built[0]} experts): set moe.ep_size={built[0]} or rebuild the model")
    ep = built[0] if built else ep
    if ep == 1:
        return ExpertPlan(1, [], [])
    blocks = [] if layers else find_moe_blocks(model)
    if not layers and not blocks:
        seen = sorted({type(m).__name__ for m in model.modules()
                       if any(w in type(m).__name__.lower() for w in ("moe", "expert"))})
        raise ValueError(f"moe.ep_size={ep} but {type(model).__name__} has no MoE layer to split: expert-parallel "
                         "serving takes zerospeed.moe.layer.MoE layers built with ep_size, or transformers' fused "
                         f"experts (3-D gate_up_proj / down_proj beside a 'gate' router); MoE-like module types seen: "
                         f"{seen or 'none'}. Drop moe.ep_size for a dense model")
    for b in blocks:
        if b.num_experts % ep:
            raise ValueError(f"moe.ep_size={ep} does not divide the {b.num_experts} experts of {b.name}; use a "
                             f"divisor of {b.num_experts}")
    tp = config.tensor_parallel
    clash = [name for name, on in (("tensor_parallel.tp_group or mpu without moe.ep_group",
                                     (tp.tp_group is not None or tp.mpu is not None) and moe.ep_group is None),
                                    ("zero stage 3 (ZeRO-Inference)", config.zero.stage == 3),
                                    ("moe.ep_mp_group", moe.ep_mp_group is not None)) if on]
    if clash:
        raise ValueError(f"expert-parallel serving (moe.ep_size={ep}) does not combine with {', '.join(clash)} yet; "
                         "drop them, or serve with moe.ep_size=1")
    return ExpertPlan(ep, blocks, layers)


def expert_mesh(tp_size: int, ep: int):
    """The `ParallelMesh` of tensor size `tp_size` and expert size `ep` (`ParallelMesh.build(tp=, ep=)`): the
    expert groups carved from the data-parallel ranks, i.e. ranks of one tensor coordinate - consecutive ranks
    at tp 1. Initialises torch.distributed from the launcher's environment if needed. Collective over the world.
    Raises ValueError when tp x ep does not divide the world size."""
    if not dist.is_initialized():
        from ..comm import init_distributed
        init_distributed()
    world = dist.get_world_size()
    if world % (tp_size * ep):
        raise ValueError(f"moe.ep_size={ep} x tensor_parallel.tp_size={tp_size} does not divide the world size "
                         f"{world}; use sizes whose product divides it (the remaining ranks serve replicas)")
    from ..parallel import ParallelMesh

    return ParallelMesh.build(tp=tp_size, ep=ep)


def expert_group(ep: int, group=None, mesh=None) -> TPGroup:
    """The expert group: `group` (DeepSpeed's `moe.ep_group`), else the `mesh`'s (`expert_mesh`). Collective
    over the world when it creates groups. Raises ValueError when ep differs from the given group's size."""
    if group is not None:
        size = dist.get_world_size(group)
        if size != ep:
            raise ValueError(f"moe.ep_size={ep} but the given moe.ep_group has {size} ranks; make them equal")
        return TPGroup(group, size, dist.get_rank(group))
    from ..runtime.moe_setup import expert_comm_group

    comm = expert_comm_group(mesh)
    return TPGroup(comm, ep, dist.get_rank(comm))


def shard_experts(model: nn.Module, plan: ExpertPlan, group: TPGroup, *, same_weights: bool) -> list[str]:
    """Split the plan's HF MoE blocks (this rank keeps rows [r E/ep, (r+1) E/ep) of each fused expert weight) and
    give every expert-holding layer the group. same_weights: check first that the group's ranks hold the same
    full weights (False when a checkpoint fills the model afterwards). Returns the names of the split experts
    modules. Raises ValueError when the ranks' weights differ."""
    from ..runtime.moe_setup import apply_autoep, attach_expert_groups
    from .tp import check_same_weights

    if plan.blocks and same_weights:
        check_same_weights(model, group.group, what="expert-parallel")
    apply_autoep(plan.blocks, group.size, group.rank)
    attach_expert_groups(model, group.group)
    return [f"{b.name}.{b.experts_name}" for b in plan.blocks]
