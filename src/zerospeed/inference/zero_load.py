"""ZeRO-Inference from a checkpoint: a model built on the meta device, partitioned as it is filled.

`init_inference(meta_model, checkpoint=..., zero={"stage": 3, "offload_param": {"device": "nvme", ...}})`
serves a model whose weights do not fit in host memory without ever holding it: each parameter is read from
the checkpoint (by group rank 0 only; the others allocate an empty tensor of its shape), registered on its
module inside `zerospeed.zero.Init`, which cuts it into the ranks' slices (and, with NVMe, writes each slice
to disk at once), and freed before the next. A rank holds about one full parameter at a time: the largest
(usually the token embedding), not the model. The ZeRO-3 engine of `init_inference` then takes the slices
over, as after any `zero.Init` build (ZeRO-Infinity, Rajbhandari et al. 2021, §5).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["build_partitioned"]


def build_partitioned(model: nn.Module, reader, zero: dict, dtype: torch.dtype) -> None:
    """Replace every meta parameter of `model` by the checkpoint's value (cast to `dtype`), partitioned by
    `zero.Init` over the world (slices on NVMe when `zero["offload_param"]["device"] == "nvme"`), and every
    meta buffer by the checkpoint's value or the model's HF `_init_weights` (rotary `inv_freq`). A parameter
    shared under several names (a tied lm_head) stays one parameter. Collective: every rank calls it with the
    same model and checkpoint. Raises ValueError, on every rank before any collective, naming the parameters
    the checkpoint lacks or holds in another shape, and the buffers nothing can recompute."""
    from ..zero import Init
    from .load import checkpoint_names, lacking

    matched = checkpoint_names(model, reader, model.named_parameters(remove_duplicate=False))
    missing = [names[0] for names, hit in matched.values() if hit is None]
    if missing:
        raise lacking(missing, reader)
    for names, (_, stored) in matched.values():  # every rank, from the headers: none is left waiting in a scatter
        want = tuple(model.get_parameter(names[0]).shape)
        if tuple(reader.shape(stored)) != want:
            raise ValueError(f"checkpoint tensor {stored} has shape {tuple(reader.shape(stored))}, the model's "
                             f"{names[0]} {want}: the checkpoint is for another model")
    _materialize_buffers(model, reader)
    remote = "nvme" if (zero.get("offload_param") or {}).get("device") == "nvme" else None
    reads_file = not dist.is_initialized() or dist.get_rank() == 0  # Init scatters group rank 0's value
    with Init(remote_device=remote, config_dict_or_path={"zero_optimization": zero} if remote else None), \
            torch.no_grad():
        for names, (_, stored) in matched.values():
            meta = model.get_parameter(names[0])
            if reads_file:
                value = reader.read(stored).to(dtype)
            else:
                value = torch.empty(meta.shape, dtype=dtype)
            param = nn.Parameter(value)  # trainable, as a plain build: ZeRO-3 swaps trainable parameters
            del value
            for name in names:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner) if owner else model, attr, param)  # Init partitions it
            del param


def _materialize_buffers(model: nn.Module, reader) -> None:
    """Every meta buffer: the checkpoint's value, else recomputed (`load.recompute_buffers`)."""
    from .load import _candidates, recompute_buffers

    available = reader.names()
    lacked = []
    for name, buf in list(model.named_buffers()):
        if not buf.is_meta:
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        hit = next((c for c in _candidates(model, name) if c in available), None)
        module._buffers[attr] = reader.read(hit).to(buf.dtype) if hit else torch.empty(buf.shape, dtype=buf.dtype)
        if hit is None:
            lacked.append(name)
    recompute_buffers(model, lacked, required=True)  # meta parameters stay meta under HF's initialiser
