"""Weights for serving from a checkpoint, each rank reading only its shard (`init_inference(checkpoint=...)`).

Sources (`open_checkpoint`):
* a `.safetensors` file, or a directory with `model.safetensors` or HF's sharded layout
  (`model.safetensors.index.json` + `model-0000i-of-0000n.safetensors`: `save_pretrained`, `zerospeed
  to-fp32`, `engine.save_16bit_model`). A tensor-parallel shard is read with safetensors' `get_slice`:
  only this rank's rows (column-parallel) or columns (row-parallel) leave the file;
* `torch.save`d state dicts (`pytorch_model.bin`, HF's sharded `pytorch_model.bin.index.json` layout, or the
  `.bin` files a DeepSpeed checkpoint json lists), loaded with `weights_only=True`, memory-mapped;
* a zerospeed training checkpoint directory (`engine.save_checkpoint`): consolidated in memory by
  `zero_to_fp32`, then sliced (convert it once with `zerospeed to-fp32` to read shards only).

With a model built on the meta device (`with torch.device("meta"): model = AutoModelForCausalLM.
from_config(cfg)`), no rank ever holds the full model: the engine shards the meta model, allocates the
shards (`to_empty`) and `load_weights` fills them. Buffers a checkpoint does not hold (HF's rotary
`inv_freq`) are recomputed by the model's own HF `_init_weights`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

__all__ = ["open_checkpoint", "load_weights", "recompute_buffers", "materialize", "checkpoint_names", "lacking",
           "SafetensorsReader", "StateDictReader", "torch_files_reader"]

INDEX = "model.safetensors.index.json"
TORCH_INDEX, TORCH_WEIGHTS = "pytorch_model.bin.index.json", "pytorch_model.bin"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")


class SafetensorsReader:
    """Tensors by name from safetensors files; `read(name, spec)` returns the full tensor or one shard."""

    def __init__(self, files: dict[str, Path]):
        self.files = files  # tensor name -> file

    @classmethod
    def from_path(cls, path: Path) -> "SafetensorsReader":
        from safetensors import safe_open

        if path.is_file():
            paths = [path]
        elif (path / INDEX).is_file():
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            return cls({name: path / fname for name, fname in weight_map.items()})
        else:
            paths = sorted(path.glob("*.safetensors"))
        if not paths:
            raise ValueError(f"checkpoint {path}: no .safetensors file and no {INDEX} found")
        files = {}
        for p in paths:
            with safe_open(str(p), framework="pt") as f:
                files.update({k: p for k in f.keys()})
        return cls(files)

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor `name`, from the file's header (no data read)."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def read(self, name: str, spec=None) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            view = f.get_slice(name)
            if spec is None:
                return view[:]
            if isinstance(spec, tuple):  # rows [start, end)
                return view[spec[0]:spec[1]]
            shape = view.get_shape()
            per_block = shape[spec.dim] // spec.blocks
            m = per_block // spec.tp
            parts = []
            for b in range(spec.blocks):
                start = b * per_block + spec.rank * m
                index = tuple(slice(None) for _ in range(spec.dim)) + (slice(start, start + m),)
                parts.append(view[index])
            return torch.cat(parts, dim=spec.dim)


class StateDictReader:
    """Tensors by name from an in-memory state dict (a consolidated zerospeed checkpoint)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def names(self) -> set[str]:
        return set(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def read(self, name: str, spec=None) -> torch.Tensor:
        full = self.state[name]
        if spec is None:
            return full
        if isinstance(spec, tuple):  # rows [start, end)
            return full[spec[0]:spec[1]]
        from ..tensor_parallel.layers import shard_tensor
        return shard_tensor(full, spec)


def open_checkpoint(source, base_dir: str = ""):
    """A reader for `source`: a path (file or directory), or DeepSpeed's checkpoint json (a dict, or a path to
    a .json file: {"type": ..., "checkpoints": [files], "base_dir": ...}; its safetensors files or torch.save
    state dicts, relative to its base_dir, else `base_dir`, else the json's directory). A json (or its directory) with
    "parallelization": "tp" is a `save_mp_checkpoint_path` save: an `mp_checkpoint.MpShardsReader`, to be
    bound to the rank. Raises ValueError for a missing path or an unknown layout, naming what was looked for."""
    from .mp_checkpoint import CONFIG_NAME, MpShardsReader

    if isinstance(source, (str, Path)) and Path(source).is_dir() and (Path(source) / CONFIG_NAME).is_file():
        source = Path(source) / CONFIG_NAME  # a save_mp_checkpoint_path directory
    if isinstance(source, (str, Path)) and str(source).endswith(".json") and Path(source).is_file():
        data = json.loads(Path(source).read_text())
        data.setdefault("base_dir", base_dir or str(Path(source).parent))
        source = data
    if isinstance(source, dict) and source.get("parallelization") == "tp":  # save_mp_checkpoint_path's shards
        return MpShardsReader(source, Path(source.get("base_dir") or base_dir or "."))
    if isinstance(source, dict):
        files = source.get("checkpoints") or []
        base = Path(source.get("base_dir") or base_dir or ".")
        paths = [base / f for f in (files if isinstance(files, list) else [files])]
        kinds = {".safetensors" if p.suffix == ".safetensors" else "torch" if p.suffix in TORCH_SUFFIXES else p.suffix
                 for p in paths}
        if not paths or len(kinds) != 1 or kinds - {".safetensors", "torch"}:
            raise ValueError(f"checkpoint json {source!r}: give safetensors files or torch.save state dicts "
                             f"({', '.join(TORCH_SUFFIXES)}), one kind, in its \"checkpoints\" list")
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ValueError(f"checkpoint json: files not found: {missing} (relative to base_dir {base})")
        if kinds == {"torch"}:
            return torch_files_reader(paths)
        readers = [SafetensorsReader.from_path(p) for p in paths]
        return SafetensorsReader({k: v for r in readers for k, v in r.files.items()})
    path = Path(source)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    if path.is_dir() and (path / "latest").is_file() or any(path.glob("*/zs_rank*.safetensors")):
        from ..utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return StateDictReader(get_fp32_state_dict_from_zero_checkpoint(path))
    if path.is_file() and path.suffix in TORCH_SUFFIXES:
        return torch_files_reader([path])
    if path.is_dir() and not any(path.glob("*.safetensors")) and not (path / INDEX).is_file():
        if (path / TORCH_INDEX).is_file():  # HF's sharded pytorch_model-0000i-of-0000n.bin
            names = sorted(set(json.loads((path / TORCH_INDEX).read_text())["weight_map"].values()))
            return torch_files_reader([path / n for n in names])
        if (path / TORCH_WEIGHTS).is_file():
            return torch_files_reader([path / TORCH_WEIGHTS])
    return SafetensorsReader.from_path(path)


def torch_files_reader(paths) -> StateDictReader:
    """The tensors of `torch.save`d state dicts (HF's `pytorch_model*.bin`), loaded with `weights_only=True` (no
    code in the file runs) and memory-mapped where the file allows it (then a shard reads only its pages)."""
    state: dict[str, torch.Tensor] = {}
    for p in paths:
        try:
            part = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a pre-1.6 (non-zip) file cannot be memory-mapped
            part = torch.load(p, map_location="cpu", weights_only=True)
        if not isinstance(part, dict):
            raise ValueError(f"checkpoint {p}: expected a state dict (name -> tensor), got {type(part).__name__}")
        state.update(part)
    return StateDictReader(state)


def materialize(model: nn.Module, device) -> None:
    """`model.to_empty(device=device)`, keeping parameters shared under several names shared (to_empty gives
    every name its own tensor: a tied lm_head would lose its tie)."""
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    for names in shared.values():
        first_owner, _, first_attr = names[0].rpartition(".")
        param = getattr(model.get_submodule(first_owner) if first_owner else model, first_attr)
        for other in names[1:]:
            owner, _, attr = other.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, param)


def _spec_of(model: nn.Module, name: str):
    """How parameter `name` is sharded: a ShardSpec (a tensor-parallel layer), a (start, end) row range (a
    vocab-parallel table, or this rank's experts of a fused expert weight), or None (whole)."""
    from ..moe.autoep import ExpertParallelExperts
    from ..tensor_parallel.layers import _ParallelLinear
    from .vocab import _VocabParallel

    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if isinstance(module, _VocabParallel) and attr == "weight":
        return (module.start, module.end)
    if isinstance(module, ExpertParallelExperts):
        return (module.ep_rank * module.num_local_experts, (module.ep_rank + 1) * module.num_local_experts)
    return module.shard_specs.get(attr) if isinstance(module, _ParallelLinear) else None


def _candidates(model: nn.Module, name: str) -> list[str]:
    """`name`, and the same without / with the HF base-model prefix (a base model's checkpoint in a LM head
    model, or the reverse)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    out = [name]
    if prefix and name.startswith(prefix + "."):
        out.append(name[len(prefix) + 1:])
    elif prefix:
        out.append(f"{prefix}.{name}")
    return out


def checkpoint_names(model: nn.Module, reader, named) -> dict[int, tuple[list[str], tuple[str, str] | None]]:
    """{id(tensor): (its names among the (name, tensor) pairs `named`, (the name it is read under, the
    checkpoint's name for it) or None when the checkpoint lacks it)}: a tensor shared under several names (a
    tied lm_head) is found under any of them, each with or without the HF base-model prefix."""
    available = reader.names()
    groups: dict[int, list[str]] = {}
    for name, t in named:
        groups.setdefault(id(t), []).append(name)
    return {key: (names, next(((n, c) for n in names for c in _candidates(model, n) if c in available), None))
            for key, names in groups.items()}


def lacking(missing: list[str], reader) -> ValueError:
    """The error for parameters `missing` from the checkpoint of `reader`."""
    shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
    return ValueError(f"the checkpoint lacks {len(missing)} parameters of the model ({shown}); it holds e.g. "
                      f"{sorted(reader.names())[:4]}")


def load_weights(model: nn.Module, reader, buffers_required: bool = False) -> list[str]:
    """Copy every parameter and buffer of `model` (already allocated: `to_empty`) from `reader`,
    tensor-parallel shards as shards, converting dtypes. A tensor shared under several names (a tied lm_head)
    is read once under any of them. The buffers the checkpoint lacks are recomputed (`recompute_buffers`;
    buffers_required: they hold no value yet, the model was built on the meta device); their names are
    returned. Raises ValueError listing the parameters it lacks."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    tensors = {id(t): t for _, t in named}
    params = {id(p) for p in model.parameters()}
    missing, unloaded_buffers = [], []
    with torch.no_grad():
        for key, (names, hit) in checkpoint_names(model, reader, named).items():
            if hit is None:
                (missing if key in params else unloaded_buffers).append(names[0])
                continue
            name, stored = hit
            value = reader.read(stored, _spec_of(model, name))
            target = tensors[key]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"checkpoint tensor {stored} has shape {tuple(value.shape)} (this rank's part), the "
                                 f"model's {name} {tuple(target.shape)}: the checkpoint is for another model")
            target.copy_(value)
    if missing:
        raise lacking(missing, reader)
    recompute_buffers(model, unloaded_buffers, buffers_required)
    return unloaded_buffers


def recompute_buffers(model: nn.Module, names: list[str], required: bool) -> None:
    """Recompute the buffers `names` a checkpoint lacked (e.g. rotary `inv_freq`) with the model's HF
    `_init_weights`, run on each owning module; the module's parameters are put back as they were. A model
    without `_init_weights` keeps its buffers, unless `required` (they hold no value: a meta-device build),
    which raises ValueError naming them."""
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        if names and required:
            raise ValueError(f"the checkpoint lacks the buffers {names[:6]} and the model (not a HF model) cannot "
                             "recompute them: build it off the meta device or save them in the checkpoint")
        return
    for owner in sorted({n.rpartition(".")[0] for n in names}):
        module = model.get_submodule(owner) if owner else model
        kept = {k: p.detach().clone() for k, p in module.named_parameters(recurse=False)}
        with torch.no_grad():
            init(module)
            for k, v in kept.items():
                getattr(module, k).copy_(v)
