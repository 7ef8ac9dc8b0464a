"""Tensor parallelism inside `zerospeed.initialize`: plan (before any process group), mesh, AutoTP, and the
hand-over of what the user built over the full parameters (model_parameters, a client optimizer)."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError
from ..tensor_parallel import apply_tensor_parallel, check_divisible, plan_for_model, tensor_parallel_layers

__all__ = ["plan_tensor_parallel", "shard_model", "remap_parameters"]


def plan_tensor_parallel(cfg, model: nn.Module, mpu):
    """The TPPlan when `tensor_parallel.autotp_size` > 1, else None. Raises ConfigError (an mpu whose
    model-parallel size is not autotp_size; no plan for the model; heads or widths tp does not divide) before any
    process group exists (with an mpu: before any is made; only its groups' sizes are read)."""
    tp = cfg.tensor_parallel.size
    if tp == 1:
        return None
    if mpu is not None:  # DeepSpeed's AutoTP example: AutoTP shards over the mpu's model-parallel group
        from ..parallel.mesh import ParallelMesh

        given = ParallelMesh.from_mpu(mpu).size("tensor")
        if given != tp:
            raise ConfigError(f"tensor_parallel.autotp_size={tp} but the mpu's model-parallel group has {given} "
                              "ranks; make them agree (AutoTP shards over the mpu's model-parallel group)")
    if any(True for _ in tensor_parallel_layers(model)):
        raise ConfigError("the model already has tensor-parallel layers, but not from zerospeed.tp_model_init (whose "
                          "mesh initialize would reuse): remove tensor_parallel.autotp_size from the config and pass "
                          "the mesh the layers were built over as mpu=..., or let AutoTP shard the unmodified model")
    from ..zero.stage3_init import partitioned_parameters

    if partitioned := partitioned_parameters(model):
        raise ConfigError(f"tensor_parallel.autotp_size={tp} with a model built under zerospeed.zero.Init() (e.g. "
                          f"{partitioned[0]!r} is partitioned) is not supported yet: AutoTP shards whole weights; "
                          "build the model without zero.Init() (ZeRO-3 still partitions each shard over the "
                          "data-parallel ranks)")
    try:
        check_divisible(model, tp)
        return plan_for_model(model, preset_model=cfg.tensor_parallel.preset_model,
                              partition_config=cfg.tensor_parallel.partition_config)
    except ValueError as exc:
        raise ConfigError(f"tensor_parallel: {exc}") from None


def shard_model(model: nn.Module, plan, mesh) -> dict[int, nn.Parameter]:
    """Apply `plan` over the mesh's tensor group; returns {id(full parameter): its shard parameter} for the
    parameters that were replaced (weights and biases of the sharded layers)."""
    before = dict(model.named_parameters(remove_duplicate=False))
    apply_tensor_parallel(model, plan, group=mesh.group("tensor"), tp=mesh.size("tensor"), rank=mesh.rank("tensor"))
    after = dict(model.named_parameters(remove_duplicate=False))
    return {id(p): after[n] for n, p in before.items() if after.get(n) is not None and after[n] is not p}


def remap_parameters(mapping: dict[int, nn.Parameter], model_parameters, optimizer):
    """Point `model_parameters` (tensors or group dicts) and a client optimizer's param groups at the shards
    that replaced the full parameters. Returns the new model_parameters. Raises ConfigError for a client
    optimizer that already holds state (it stepped on full parameters)."""
    if not mapping:
        return model_parameters
    swap = lambda t: mapping.get(id(t), t)  # noqa: E731
    if isinstance(optimizer, torch.optim.Optimizer):
        if any(optimizer.state.values()):
            raise ConfigError("the client optimizer already has state (it stepped): with tensor parallelism its "
                              "parameters are replaced by shards; build the optimizer fresh, before training")
        for g in optimizer.param_groups:
            g["params"] = [swap(t) for t in g["params"]]
    if model_parameters is None:
        return None
    if isinstance(model_parameters, torch.Tensor):
        return swap(model_parameters)
    items = list(model_parameters)
    if items and all(isinstance(x, dict) for x in items):
        return [{**g, "params": [swap(t) for t in ([g["params"]] if isinstance(g["params"], torch.Tensor)
                                                   else list(g["params"]))]} for g in items]
    return [swap(t) for t in items]
