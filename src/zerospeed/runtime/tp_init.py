"""`zerospeed.tp_model_init`: shard a model over a tensor-parallel mesh before `zerospeed.initialize`.

    model = zerospeed.tp_model_init(model, tp_size=2, dtype=torch.float32)
    engine, *_ = zerospeed.initialize(model=model, config=ds_config)   # no autotp_size needed

DeepSpeed's `deepspeed.tp_model_init(model, tp_size, dtype, config=None, **kwargs)` signature. DeepSpeed
0.19.8's only records its arguments and shards inside `deepspeed.initialize` (merging them into the
config's `tensor_parallel` block, an error on a conflicting `autotp_size` or dtype); its earlier
releases sharded at once. Here the model is sharded at once (so it can be inspected, or handed to
code that wants the local shards), and `initialize` merges the same way: it finds the mesh the model
was sharded over in a registry keyed weakly by the model (`sharded_mesh`), fills a missing
`tensor_parallel.autotp_size` with its size, and builds no other groups.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..comm.init import default_device, read_launch_env
from ..comm.ops import broadcast
from ..config import ConfigError, parse_source
from ..config.tensor_parallel import TensorParallelConfig
from ..parallel import ParallelMesh
from ..tensor_parallel import apply_tensor_parallel, plan_for_model

__all__ = ["tp_model_init", "sharded_mesh", "merge_tp_model_init"]

# model -> the ParallelMesh tp_model_init sharded it over; weak, so a dropped model drops its entry
_SHARDED: "weakref.WeakKeyDictionary[nn.Module, ParallelMesh]" = weakref.WeakKeyDictionary()
_PLAN_KWARGS = ("preset_model", "partition_config")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs) -> nn.Module:
    """Shard `model`'s linear layers over tensor-parallel groups of `tp_size` ranks and cast it to `dtype`.

    Collective: every rank calls it with the same arguments, after torch.distributed is initialised.
    Builds `ParallelMesh.build(tp=tp_size)` (or uses `mesh=`, a ParallelMesh of that tensor size),
    broadcasts every parameter and buffer from global rank 0 (all ranks start from the same full
    weights, as `initialize` does), replaces the layers of `plan_for_model(model, preset_model=...,
    partition_config=...)` by `ColumnParallelLinear` / `RowParallelLinear` holding this rank's shard
    (`apply_tensor_parallel` over the mesh's "tensor" group), then `model.to(dtype)`.

    config: a ds_config (dict, path, JSON) whose `tensor_parallel` block supplies `preset_model` /
    `partition_config` (kwargs win) and whose `autotp_size`, if set, must equal tp_size.
    kwargs: `preset_model`, `partition_config`, `mesh`. With dtype bf16/fp16 the fp32 master weights
    of a later `initialize` start from the cast values; dtype=torch.float32 keeps them exact (the
    config's bf16/fp16 section then casts the model inside `initialize`).
    Returns `model` (the same object, modified in place). Raises RuntimeError when torch.distributed is
    not initialised; ValueError for a tp_size the world, heads or widths do not divide (naming them), a
    model without a plan, a conflicting config, or a model already sharded; TypeError for unknown kwargs.
    """
    import torch.distributed as dist

    unknown = sorted(set(kwargs) - {*_PLAN_KWARGS, "mesh"})
    if unknown:
        hint = (" (a tp_group cannot be given: zerospeed builds the groups; pass mesh=zerospeed.parallel."
                "ParallelMesh.build(tp=...) to choose the layout)") if "tp_group" in unknown else ""
        raise TypeError(f"tp_model_init() got unknown keyword arguments {unknown}; accepted: "
                        f"{[*_PLAN_KWARGS, 'mesh']}{hint}")
    if not dist.is_initialized():
        raise RuntimeError("tp_model_init() needs torch.distributed initialised first: call "
                           "zerospeed.init_distributed() (or torchrun + dist.init_process_group) before it")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"tp_model_init(dtype={dtype!r}): pass a floating-point torch.dtype, e.g. torch.bfloat16")
    tp_block = TensorParallelConfig.model_validate((parse_source(config) if config is not None else {})
                                                   .get("tensor_parallel") or {})
    if tp_block.autotp_size > 1 and tp_block.autotp_size != tp_size:
        raise ValueError(f"tp_model_init(tp_size={tp_size}) conflicts with the config's "
                         f"tensor_parallel.autotp_size={tp_block.autotp_size}; make them equal or drop the key")
    if model in _SHARDED:
        raise ValueError("tp_model_init() already sharded this model; call it once per model")
    mesh = kwargs.get("mesh") or ParallelMesh.build(tp=tp_size)
    if mesh.size("tensor") != tp_size:
        raise ValueError(f"mesh={mesh!r} has tensor-parallel size {mesh.size('tensor')}, not tp_size={tp_size}")
    plan_kwargs = {k: kwargs.get(k, getattr(tp_block, k)) for k in _PLAN_KWARGS}
    plan = plan_for_model(model, **plan_kwargs)
    model.to(default_device(read_launch_env().local_rank))
    with torch.no_grad():  # the same full weights everywhere before each rank keeps its shard
        for t in list(model.parameters()) + list(model.buffers()):
            broadcast(t.data, 0, group=None)
    apply_tensor_parallel(model, plan, group=mesh.group("tensor"), tp=tp_size, rank=mesh.rank("tensor"))
    model.to(dtype)
    _SHARDED[model] = mesh
    return model


def sharded_mesh(model: nn.Module) -> ParallelMesh | None:
    """The mesh `tp_model_init` sharded `model` over, or None if it did not."""
    return _SHARDED.get(model)


def merge_tp_model_init(source: Any, model: nn.Module, mesh: ParallelMesh, mpu) -> dict:
    """The ds_config `source` as a dict with `tensor_parallel.autotp_size` set to the mesh's tensor size (as
    DeepSpeed's `merge_tp_model_init_into_config`). Raises ConfigError for an mpu other than the mesh, a
    different autotp_size, or a model dtype (bf16/fp16) the config's bf16/fp16 sections do not enable."""
    if mpu is not None and mpu is not mesh:
        raise ConfigError("the model was sharded by zerospeed.tp_model_init, which built its own process groups; "
                          "do not pass mpu=... to initialize (or pass the mesh given to tp_model_init)")
    tp = mesh.size("tensor")
    raw = parse_source(source)
    block = raw.setdefault("tensor_parallel", {})
    if not isinstance(block, dict):
        raise ConfigError(f"tensor_parallel must be a JSON object, got {type(block).__name__}")
    size = block.get("autotp_size")
    if size not in (None, 0, 1, tp):
        raise ConfigError(f"tensor_parallel.autotp_size={size} conflicts with tp_model_init(tp_size={tp}); make them "
                          "equal or drop the key")
    block["autotp_size"] = tp
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    section = next((s for s, d in _DTYPES.items() if d == dtype), None)
    enabled = {s for s in _DTYPES if isinstance(raw.get(s), dict) and raw[s].get("enabled") in (True, "auto")}
    if section is not None and section not in enabled:
        raise ConfigError(f"the model is {dtype} (tp_model_init's dtype) but the config does not enable "
                          f"\"{section}\": add \"{section}\": {{\"enabled\": true}}, or call tp_model_init with "
                          "dtype=torch.float32 (the config's precision then casts the model)")
    return raw
