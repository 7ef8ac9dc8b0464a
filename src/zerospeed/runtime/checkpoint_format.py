"""The on-disk layout of a zerospeed checkpoint, and the reader every loader uses.

    save_dir/latest                          text: the tag of the newest complete checkpoint (written last)
    save_dir/<tag>/index.json                what is stored where (below)
    save_dir/<tag>/engine_state.json         counters, LR scheduler, optimizer hyper-parameters, loss scaler,
                                             data-loader position, client_state (JSON; tensors in rank 0's file)
    save_dir/<tag>/zs_rank00000.safetensors  what rank 0 owned (one file per data-parallel rank)

index.json:
    {"format": "zerospeed-checkpoint", "version": 1, "tag", "world_size", "zero_stage",
     "optimizer": class name or null, "elementwise_states": {"exp_avg": "F32", ...},
     "scalar_states": {"step": "F32"}, "excluded_frozen": bool,
     "files": {"zs_rank00000.safetensors": {"rank": 0, "bytes": n, "crc32": {key: crc}}},
     "tensors": {name: {"kind": "param" | "frozen" | "buffer", "shape": [...], "dtype": "F32",
                        "aliases": [other names of a tied parameter], "fragments": [[rank, start, end], ...],
                        "scalar_rank": rank holding its 0-d optimizer states or null}}}

A logical tensor is stored as fragments, flat element ranges [start, end) of the flattened tensor,
each in the file of the rank that owned it: key "<name>:<field>:<start>" where field is "master"
(fp32 master weight), an optimizer state name ("exp_avg", ...) or "value" (buffers and frozen
parameters, stored whole). 0-d optimizer states: "<name>:<field>". RNG states: "rng/...". Tensors
inside engine_state.json: "state/<n>". Readers need no model code, no zerospeed classes, no pickle.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .checkpoint_io import CODE_DTYPES, CheckpointError, CheckpointFileError, SafetensorsFile

FORMAT, VERSION = "zerospeed-checkpoint", 1
LATEST, INDEX, ENGINE_STATE = "latest", "index.json", "engine_state.json"


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was saved from another model: the message lists missing, unexpected and
    mis-shaped keys."""


def rank_file(rank: int) -> str:
    return f"zs_rank{rank:05d}.safetensors"


def fragment_key(name: str, field: str, start: int) -> str:
    return f"{name}:{field}:{start}"


def scalar_key(name: str, field: str) -> str:
    return f"{name}:{field}"


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file of the checkpoint. Raises CheckpointFileError naming it if missing or corrupt."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointFileError(f"checkpoint file {path} is missing") from None
    except ValueError as exc:
        raise CheckpointFileError(f"checkpoint file {path} is corrupt: {exc}") from None


def read_index(tag_dir: Path) -> dict[str, Any]:
    """index.json of a checkpoint directory, format-checked. Raises CheckpointError / CheckpointFileError."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        raise CheckpointError(f"no checkpoint directory {tag_dir} (an interrupted save leaves only "
                              f"{tag_dir.name}.tmp-* directories, never a partial {tag_dir.name})")
    index = read_json(tag_dir / INDEX)
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{tag_dir / INDEX} is not a zerospeed checkpoint index (format={index.get('format')!r})")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{tag_dir / INDEX} has format version {index.get('version')}; "
                              f"this zerospeed reads {VERSION}")
    return index


def resolve_tag_dir(path: str | Path, tag: str | None = None) -> Path | None:
    """The checkpoint directory for `path` (a save_dir or a tag directory itself) and `tag` (default:
    the tag in `path/latest`). None if no tag is given and `path/latest` does not exist."""
    path = Path(path)
    if tag is None and (path / INDEX).is_file():
        return path
    if tag is None:
        latest = path / LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
    return path / tag


class CheckpointReader:
    """Reads any flat element range of any logical tensor of one checkpoint, whatever wrote it.

    Opens each rank file on first use (validating its size and header) and keeps it open until
    close(). Implements `zerospeed.zero.fragments.FragmentReader`. Stored fragments read whole are
    CRC-checked. Errors (CheckpointFileError / CheckpointError) name the file, tensor and range.
    """

    def __init__(self, tag_dir: Path, index: dict[str, Any] | None = None):
        self.dir = Path(tag_dir)
        self.index = index if index is not None else read_index(self.dir)
        self.tensors: dict[str, dict[str, Any]] = self.index["tensors"]
        self.elementwise_states = {k: CODE_DTYPES[v] for k, v in self.index.get("elementwise_states", {}).items()}
        self.scalar_states = {k: CODE_DTYPES[v] for k, v in self.index.get("scalar_states", {}).items()}
        self._by_rank = {info["rank"]: (name, info) for name, info in self.index["files"].items()}
        self._open: dict[int, SafetensorsFile] = {}

    def file(self, rank: int) -> SafetensorsFile:
        """The (validated) file rank `rank` wrote."""
        if rank not in self._open:
            if rank not in self._by_rank:
                raise CheckpointError(f"{self.dir / INDEX} lists no file for rank {rank}")
            name, info = self._by_rank[rank]
            self._open[rank] = SafetensorsFile(self.dir / name, expected_bytes=info.get("bytes"))
        return self._open[rank]

    def _crc(self, rank: int, key: str) -> int | None:
        return self._by_rank[rank][1].get("crc32", {}).get(key)

    def entry(self, name: str) -> dict[str, Any]:
        if name not in self.tensors:
            raise CheckpointError(f"checkpoint {self.dir} has no tensor {name!r}")
        return self.tensors[name]

    def read(self, name: str, field: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of logical tensor `name`'s `field`, flattened, in the stored dtype (1-D)."""
        entry = self.entry(name)
        dtype = CODE_DTYPES[entry["dtype"]] if field in ("master", "value") else self.elementwise_states.get(field)
        if dtype is None:
            raise CheckpointError(f"checkpoint {self.dir} stores no optimizer state {field!r}")
        out = torch.empty(end - start, dtype=dtype)
        covered = 0
        for rank, a, b in entry["fragments"]:
            lo, hi = max(a, start), min(b, end)
            if lo >= hi:
                continue
            key = fragment_key(name, field, a)
            whole = lo == a and hi == b
            part = self.file(rank).read(key, crc32=self._crc(rank, key)).reshape(-1) if whole else \
                self.file(rank).read(key, lo - a, hi - a)
            out[lo - start:hi - start].copy_(part)
            covered += hi - lo
        if covered != end - start:
            raise CheckpointError(f"checkpoint {self.dir}: the fragments of {name!r} ({field}) cover {covered} of the "
                                  f"{end - start} elements [{start}, {end}); index.json is inconsistent")
        return out

    def read_full(self, name: str, field: str | None = None) -> torch.Tensor:
        """The whole logical tensor `name` in its shape (field default: master / value by kind)."""
        entry = self.entry(name)
        field = field or ("master" if entry["kind"] == "param" else "value")
        shape = tuple(entry["shape"])
        numel = 1
        for s in shape:
            numel *= s
        return self.read(name, field, 0, numel).view(shape)

    def scalar(self, name: str | None, field: str) -> torch.Tensor:
        """The 0-d optimizer state `field` stored with parameter `name` (None: the first parameter that has one)."""
        if name is None:
            name = next((n for n, e in self.tensors.items() if e.get("scalar_rank") is not None), None)
        rank = self.entry(name).get("scalar_rank") if name is not None else None
        if rank is None:
            raise CheckpointError(f"checkpoint {self.dir} stores no 0-d optimizer state {field!r} for {name!r}")
        key = scalar_key(name, field)
        return self.file(rank).read(key, crc32=self._crc(rank, key))

    def extra(self, rank: int, key: str) -> torch.Tensor:
        """A tensor stored under `key` in rank `rank`'s file (RNG states, tensors of engine_state.json)."""
        return self.file(rank).read(key, crc32=self._crc(rank, key))

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
