"""`save_mp_checkpoint_path`: the served model's tensor-parallel shards saved for a fast reload.

DeepSpeed's `init_inference(..., save_mp_checkpoint_path=DIR)` writes, once the model is sharded, each
rank's part of the sharded layers and rank 0's copy of the rest, plus `DIR/ds_inference_config.json`:

    {"type": "ds_model", "base_dir": DIR, "checkpoints": {"non_tp": [...], "tp": [...]}, "version": 1.0,
     "parallelization": "tp", "tp_size": N, "dtype": "float32"}

Passing that json as `checkpoint=` to a later `init_inference` at the same tp size lets each rank read its own
file whole, without slicing the full tensors. Same layout and json here, with safetensors files instead of
DeepSpeed's pickles (`torch.load` of a pickle can run code; these load with no pickle at all):
`non-tp.safetensors` (rank 0: the tensors every rank holds whole) and `tp_<rank:02d>_00.safetensors` (each
rank: its shards of the tensor-parallel layers and vocabulary tables, under the model's names). With expert
parallelism (`moe.ep_size` E > 1) also `ep_<rank:02d>.safetensors`: expert rank r's rows of each fused expert
tensor, and `"ep_size": E` in the json; a reload reads the rows it holds at any expert-parallel size. A tensor
shared under several names (a tied lm_head) is stored once. A json of DeepSpeed's own (its `.pt` files) is
refused by `open_checkpoint`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..utils.io import atomic_write

__all__ = ["CONFIG_NAME", "save_mp_checkpoint", "MpShardsReader"]

CONFIG_NAME = "ds_inference_config.json"
NON_TP = "non-tp.safetensors"
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _tp_file(rank: int) -> str:
    return f"tp_{rank:02d}_00.safetensors"


def _ep_file(rank: int) -> str:
    return f"ep_{rank:02d}.safetensors"


def _is_expert(model: nn.Module, name: str) -> bool:
    from ..moe.autoep import ExpertParallelExperts

    owner = name.rpartition(".")[0]
    return isinstance(model.get_submodule(owner) if owner else model, ExpertParallelExperts)


def save_mp_checkpoint(model: nn.Module, path, tp, ep=None) -> Path:
    """Write `model`'s tensors (sharded in place by `init_inference`; tp: its `TPGroup`, ep: its expert group,
    same triple, or None) under directory `path` as the module docstring lays out (the tensor-parallel group
    holding global rank 0 writes: replicas hold the same shards; each expert file is written by the lowest
    global rank of that expert rank); returns the json's path. Collective over the world when torch.distributed
    is initialised: the outcome is agreed, and global rank 0 writes the json last, only if every file was
    written. `init_inference` calls it before any int8 quantization: the files hold the float shards, and a later
    `dtype=torch.int8` run quantizes them as it loads. Raises the rank's own error, or CheckpointError naming a
    failed rank."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from .load import _spec_of

    path = Path(path)
    ep_size, ep_rank = (ep.size, ep.rank) if ep is not None else (1, 0)
    sharded, whole, experts, seen = {}, {}, {}, set()
    keep = set(model.state_dict(keep_vars=True))  # persistent buffers only
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in keep or id(t) in seen:
            continue
        seen.add(id(t))
        kind = experts if ep_size > 1 and _is_expert(model, name) else \
            sharded if _spec_of(model, name) is not None else whole
        kind[name] = t.detach().contiguous().cpu()
    distributed = dist.is_available() and dist.is_initialized()
    expert_writer = ep_size > 1  # the lowest global rank of each expert rank writes its experts
    if expert_writer and distributed:
        from ..runtime.checkpoint import _all_gather_object

        ranks = _all_gather_object(ep_rank, None)
        expert_writer = ranks.index(ep_rank) == dist.get_rank()
    # the tensor-parallel group holding global rank 0 writes (other replicas hold the same shards)
    if not distributed:
        writer = True
    elif tp.size == 1:  # every rank serves alone: rank 0 writes
        writer = dist.get_rank() == 0
    else:
        writer = tp.group is None or 0 in dist.get_process_group_ranks(tp.group)
    own = None
    if writer or expert_writer:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if writer:
                atomic_write(path / _tp_file(tp.rank), lambda tmp: save_file(sharded, str(tmp)))
            if writer and tp.rank == 0:
                atomic_write(path / NON_TP, lambda tmp: save_file(whole, str(tmp)))
            if expert_writer:
                atomic_write(path / _ep_file(ep_rank), lambda tmp: save_file(experts, str(tmp)))
        except Exception as exc:  # noqa: BLE001 - agreed below, raised on every rank
            own = exc
    if distributed:  # agreed over the world: every rank raises if any failed
        from ..runtime.checkpoint import _all_gather_object, _raise_gathered

        errors = _all_gather_object(None if own is None else (type(own).__name__, str(own)), None)
        _raise_gathered(errors, own, f"save_mp_checkpoint_path {path}")
    elif own is not None:
        raise own
    config = path / CONFIG_NAME
    if not distributed or dist.get_rank() == 0:
        dtype = next((t.dtype for t in whole.values() if t.is_floating_point()), torch.float32)
        data = {"type": "ds_model", "base_dir": str(path), "version": 1.0, "parallelization": "tp",
                "tp_size": tp.size, "dtype": _DTYPES.get(dtype, str(dtype).removeprefix("torch.")),
                "checkpoints": {"non_tp": [NON_TP], "tp": [_tp_file(r) for r in range(tp.size)]}}
        if ep_size > 1:
            data["ep_size"] = ep_size
            data["checkpoints"]["ep"] = [_ep_file(r) for r in range(ep_size)]
        atomic_write(config, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1)))
    if distributed:
        dist.barrier()  # the json exists on return, on every rank
    return config


class MpShardsReader:
    """Reads a `save_mp_checkpoint` directory (data: its json, base: the directory): `bind(rank, size)` once the
    tensor-parallel group is known, then `names()` / `read(name, spec)` as `load.SafetensorsReader`, this
    rank's shards whole (they are already its part). Raises ValueError for missing files or, at bind, another
    tp size than the one saved."""

    def __init__(self, data: dict, base: Path):
        self.tp_size = int(data.get("tp_size", 1))
        files = data.get("checkpoints") or {}
        self.non_tp = [base / f for f in files.get("non_tp", [])]
        self.tp = [base / f for f in files.get("tp", [])]
        self.ep = [base / f for f in files.get("ep", [])]  # expert rank r's rows, in order
        bad = [str(p) for p in self.non_tp + self.tp + self.ep if p.suffix != ".safetensors" or not p.is_file()]
        if bad or len(self.tp) != self.tp_size:
            raise ValueError(f"tensor-parallel checkpoint {base}: expected {self.tp_size} tp files and safetensors "
                             f"files that exist; missing or not safetensors: {bad[:4]} (a DeepSpeed .pt checkpoint "
                             "is not read: reload the original weights)")
        self._whole = self._shards = None

    def bind(self, rank: int, size: int) -> None:
        if size != self.tp_size:
            raise ValueError(f"the checkpoint was saved at tensor-parallel size {self.tp_size} "
                             f"(save_mp_checkpoint_path), this run uses tp_size={size}: serve it at tp_size="
                             f"{self.tp_size}, or load the original full weights")
        from .load import SafetensorsReader

        self._whole = SafetensorsReader({k: v for p in self.non_tp for k, v in SafetensorsReader.from_path(p).files.items()})
        self._shards = SafetensorsReader.from_path(self.tp[rank])
        self._experts = [SafetensorsReader.from_path(p) for p in self.ep]

    def _bound(self):
        if self._shards is None:
            raise RuntimeError("MpShardsReader.read() before bind(rank, size)")
        return self._whole, self._shards

    def names(self) -> set[str]:
        whole, shards = self._bound()
        return whole.names() | shards.names() | (self._experts[0].names() if self._experts else set())

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape `read(name)` returns: this rank's part of a tp shard, every expert, or the whole tensor."""
        whole, shards = self._bound()
        if name in shards.files:
            return shards.shape(name)
        if self._experts and name in self._experts[0].files:
            rows = [r.shape(name) for r in self._experts]
            return (sum(r[0] for r in rows), *rows[0][1:])
        return whole.shape(name)

    def read(self, name: str, spec=None) -> torch.Tensor:
        whole, shards = self._bound()
        if name in shards.files:
            return shards.read(name)  # this rank's part, as saved
        if self._experts and name in self._experts[0].files:
            return self._expert_rows(name, spec)
        return whole.read(name, spec)

    def _expert_rows(self, name: str, spec) -> torch.Tensor:
        """Experts [lo, hi) of a fused expert tensor (all for spec None) from the expert files that hold them:
        file r holds rows [r L, (r + 1) L), so a run at another expert-parallel size reads across files."""
        parts, start = [], 0
        lo, hi = spec if spec is not None else (0, None)
        for reader in self._experts:
            end = start + reader.shape(name)[0]
            a, b = max(lo, start), end if hi is None else min(hi, end)
            if a < b:
                parts.append(reader.read(name, (a - start, b - start)))
            start = end
        return torch.cat(parts)
