"""Tensor-parallel serving: the group, the sharding plan and the checks, reusing the training AutoTP.

The model's linear layers are sharded exactly as `tensor_parallel.autotp_size` shards them for training
(`zerospeed.tensor_parallel.apply_tensor_parallel`, Megatron-LM's column -> row split: Shoeybi et al. 2019,
§3): attention heads and MLP columns over the tp ranks, one all-reduce per attention block and per MLP
block, the KV cache holding this rank's heads only (HF caches what its attention computes). The token
embedding and lm_head are split by vocabulary rows (`inference/vocab.py`); norms and position tables stay
whole on every rank.

The plan is the model type's preset (llama, mistral, qwen2, qwen3, gpt2), else the model's HF
`base_model_tp_plan`, else DeepSpeed's `injection_policy` ({layer class: names of its output linears}).
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from ..tensor_parallel import apply_tensor_parallel, plan_for_model
from ..tensor_parallel.plan import PRESETS, TPPlan, TPRule

__all__ = ["TPGroup", "tp_group", "inference_plan", "shard_for_inference", "check_same_weights"]


class TPGroup:
    """The tensor-parallel group a model is served over: `group` (None = the world), `size`, `rank`."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def __repr__(self) -> str:
        return f"TPGroup(size={self.size}, rank={self.rank})"


def tp_group(tp_size: int, *, group=None, mpu=None, mesh=None) -> TPGroup:
    """The group to shard over: the mpu's model-parallel group, `group`, the `mesh`'s "tensor" group (a
    `ParallelMesh` built with expert groups too), or consecutive ranks of `tp_size` (`ParallelMesh.build(
    tp=tp_size)`: the other ranks hold replicas). Initialises torch.distributed from the launcher's environment
    if needed. Raises ValueError when tp_size does not divide the world size or disagrees with the group's size."""
    if tp_size == 1 and group is None and mpu is None:
        return TPGroup(None, 1, 0)
    if mesh is not None and group is None and mpu is None:
        return TPGroup(mesh.group("tensor"), tp_size, mesh.rank("tensor"))
    if not dist.is_initialized():
        from ..comm import init_distributed
        init_distributed()
    if mpu is not None:  # a Megatron-style mpu, validated and read as the training engine reads one
        from ..parallel import ParallelMesh
        mesh = ParallelMesh.from_mpu(mpu)
        if mesh.size("tensor") == 1:
            return TPGroup(None, 1, 0)
        group = mesh.group("tensor")
    if group is not None:
        size = dist.get_world_size(group)
        if tp_size > 1 and size != tp_size:
            raise ValueError(f"tensor_parallel.tp_size={tp_size} but the given tp_group/mpu group has {size} ranks; "
                             "make them equal or drop tp_size")
        return TPGroup(group, size, dist.get_rank(group))
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"tensor_parallel.tp_size={tp_size} does not divide the world size {world}; use a tp size "
                         f"that divides it (the remaining world / tp ranks serve replicas)")
    from ..parallel import ParallelMesh
    mesh = ParallelMesh.build(tp=tp_size)
    return TPGroup(mesh.group("tensor"), tp_size, mesh.rank("tensor"))


def _policy_plan(model: nn.Module, policy: dict) -> TPPlan:
    """DeepSpeed's `injection_policy` {layer class: (output linear names, ...)} as a plan: inside every
    instance of a listed class, the named linears are row-parallel and every other linear column-parallel
    (fused blocks from the model type's preset where one matches)."""
    preset = PRESETS.get(getattr(getattr(model, "config", None), "model_type", None))
    rules = []
    for cls, outputs in policy.items():
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"injection_policy key {cls!r} is not an nn.Module subclass; write "
                             "{DecoderLayerClass: ('self_attn.o_proj', 'mlp.down_proj')}")
        outputs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
        owners = [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]
        if not owners:
            raise ValueError(f"injection_policy names {cls.__name__}, which the model does not contain")
        for owner, module in owners:
            names = [n for n, c in module.named_modules() if isinstance(c, nn.Linear) or type(c).__name__ == "Conv1D"]
            for out in outputs:
                if not any(n.endswith(out) for n in names):
                    raise ValueError(f"injection policy layer {out!r} is not a linear layer of {cls.__name__} "
                                     f"(its linear layers: {names})")
            for n in names:
                full = f"{owner}.{n}.weight" if owner else f"{n}.weight"
                kind = "row" if any(n.endswith(o) for o in outputs) else "column"
                base = preset.rule_for(full) if preset is not None else None
                blocks = base.blocks if base is not None and base.partition_type == kind else 1
                rules.append(TPRule((re.escape(full) + "$",), kind, blocks))
    fixups = preset.attention_fixups if preset is not None else ()
    return TPPlan(tuple(rules), "injection_policy", fixups)


def inference_plan(model: nn.Module, injection_policy: dict | None = None) -> TPPlan:
    """The sharding plan: `injection_policy` if given, else the preset / HF plan. Raises ValueError for a
    model without a plan, naming its layer types and how to write an injection_policy."""
    if injection_policy:
        return _policy_plan(model, injection_policy)
    try:
        return plan_for_model(model)
    except ValueError:
        layers = sorted({type(m).__name__ for m in model.modules()
                         if any(isinstance(c, nn.Linear) for c in m.children()) and m is not model})
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(f"no tensor-parallel plan for model type {model_type!r} (presets: {sorted(PRESETS)}). "
                         f"Name the output linear layers of its repeated blocks (module types with linear layers: "
                         f"{layers}) in injection_policy, e.g. init_inference(model, tensor_parallel={{'tp_size': 2}}, "
                         "injection_policy={DecoderLayer: ('self_attn.o_proj', 'mlp.down_proj')}): those are "
                         "row-parallel, the block's other linear layers column-parallel") from None


def check_same_weights(model: nn.Module, group, what: str = "tensor-parallel") -> None:
    """Raise ValueError if the ranks of `group` hold different weights (a per-tensor float64 sum, compared by
    an all-reduce of max and min): tensor (or expert) parallelism shards one model, so every rank must start
    from the same full weights (load the same checkpoint, or build with the same seed). what: the ranks' name
    in the message."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    if not tensors:
        return
    device = tensors[0].device
    sums = torch.stack([t.detach().double().sum().to(device) for t in tensors])
    sums = torch.nan_to_num(sums, nan=1.2345e300)
    hi, lo = sums.clone(), sums.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    bad = (hi != lo).nonzero().flatten().tolist()
    if bad:
        names = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_floating_point()]
        shown = ", ".join(names[i] for i in bad[:4])
        raise ValueError(f"the {what} ranks hold different weights ({len(bad)} tensors differ, e.g. {shown}); "
                         "every rank must start from the same full model: load the same checkpoint, or seed "
                         "(torch.manual_seed) identically before building it")


def shard_for_inference(model: nn.Module, plan: TPPlan, tp: TPGroup) -> list[str]:
    """Replace the plan's layers by tensor-parallel ones holding shard `tp.rank`, and a HF model's token
    embedding and lm_head by vocab-parallel ones (`inference/vocab.py`); returns the replaced names."""
    from .vocab import shard_vocab

    names = apply_tensor_parallel(model, plan, group=tp.group, tp=tp.size, rank=tp.rank)
    return names + shard_vocab(model, group=tp.group, tp=tp.size, rank=tp.rank)
