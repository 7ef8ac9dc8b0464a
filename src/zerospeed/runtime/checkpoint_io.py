"""Checkpoint file I/O: a streaming safetensors writer and reader, and a JSON codec that keeps tensors.

Files are standard safetensors (readable by `safetensors.safe_open`): 8-byte little-endian header
length, a JSON header {key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str:
str}} padded with spaces to 8 bytes, then the raw little-endian bytes in header order. We write and
read them ourselves because

* writing streams: the header is built from (key, dtype, shape) first, then each tensor is produced,
  written and dropped, so peak memory is one tensor, never the whole file's contents
  (`safetensors.torch.save_file` needs them all at once);
* reading uses plain `readinto` into a fresh tensor, never `mmap`: memory stays what the caller keeps
  (mapped pages touched by `safe_open` stay resident while the file is open), and a truncated or
  corrupt file fails with an error naming it before any tensor is read.

Nothing here unpickles: JSON and raw tensor bytes only.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # bytes; safetensors' own limit


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says which file / rank / key and why."""


class CheckpointFileError(CheckpointError):
    """A checkpoint file is missing, truncated or corrupt; the message names the file."""


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors dtype code ("F32", "BF16", ...). Raises TypeError for an unsupported dtype."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors") from None


def _as_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview | bytes]:
    """(keep-alive tensor, zero-copy byte view of its elements). Not `Tensor.numpy()`: that marks the
    storage non-resizable for good, which breaks ZeRO-3's freeing of gathered buffers."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    nbytes = flat.numel() * flat.element_size()
    if not nbytes:
        return flat, b""
    return flat, memoryview((ctypes.c_char * nbytes).from_address(flat.data_ptr())).cast("B")


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so renames and new entries in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: str | os.PathLike, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...],
                      Callable[[], torch.Tensor]]], *, metadata: dict[str, str] | None = None,
                      fsync: bool = True) -> dict[str, Any]:
    """Write a safetensors file, producing one tensor at a time.

    entries: (key, dtype, shape, produce) in file order; `produce()` returns the tensor (any layout;
    it must have that dtype and shape) and is called once, after the header is written.
    Returns {"bytes": file size, "crc32": {key: CRC-32 of the tensor's bytes}}. The file is fsynced
    (unless fsync=False) but not renamed: callers write under a temporary name.
    Raises ValueError if a produced tensor does not match its declared dtype / shape.
    """
    entries = list(entries)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for key, dtype, shape, _ in entries:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": dtype_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    crcs: dict[str, int] = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, dtype, shape, produce in entries:
            t = produce()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{path}: tensor {key!r} was declared {dtype} {list(shape)} but produced "
                                 f"{t.dtype} {list(t.shape)}")
            keep, data = _as_bytes(t)
            crcs[key] = zlib.crc32(data)
            f.write(data)
            del t, keep, data
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        size = f.tell()
    return {"bytes": size, "crc32": crcs}


class SafetensorsFile:
    """A safetensors file opened for random reads of flat element ranges (no mmap).

    Validates on open: the header parses, dtypes are known, offsets are contiguous, and the file
    size equals header + data (a truncated file is reported with both numbers).
    Raises CheckpointFileError naming `path` for a missing, truncated or corrupt file.
    """

    def __init__(self, path: str | os.PathLike, *, expected_bytes: int | None = None):
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb")
        except FileNotFoundError:
            raise CheckpointFileError(f"checkpoint file {self.path} is missing") from None
        try:
            self._parse(expected_bytes)
        except BaseException:
            self._f.close()
            raise

    def _parse(self, expected_bytes: int | None) -> None:
        size = os.fstat(self._f.fileno()).st_size
        if expected_bytes is not None and size != expected_bytes:
            raise CheckpointFileError(f"checkpoint file {self.path} has {size} bytes but the index recorded "
                                      f"{expected_bytes}: it is truncated or was overwritten")
        head = self._f.read(8)
        if len(head) < 8:
            raise CheckpointFileError(f"checkpoint file {self.path} is truncated ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointFileError(f"checkpoint file {self.path} is corrupt or truncated: header length {n} "
                                      f"does not fit in {size} bytes")
        try:
            header = json.loads(self._f.read(n))
        except ValueError as exc:
            raise CheckpointFileError(f"checkpoint file {self.path} is corrupt: unreadable header ({exc})") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._base = 8 + n
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        end = 0
        for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, stop = info["data_offsets"]
            dtype = CODE_DTYPES.get(info["dtype"])
            if dtype is None or begin != end or stop - begin != math.prod(info["shape"]) * dtype.itemsize:
                raise CheckpointFileError(f"checkpoint file {self.path} is corrupt: bad header entry for {key!r}")
            self.tensors[key] = (dtype, tuple(info["shape"]), begin, stop)
            end = stop
        if self._base + end != size:
            raise CheckpointFileError(f"checkpoint file {self.path} is truncated or corrupt: its header describes "
                                      f"{self._base + end} bytes, the file has {size}")

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of `key`. Raises CheckpointFileError if the file lacks it."""
        if key not in self.tensors:
            raise CheckpointFileError(f"checkpoint file {self.path} has no tensor {key!r}")
        return self.tensors[key][:2]

    def read(self, key: str, start: int = 0, end: int | None = None, *, crc32: int | None = None) -> torch.Tensor:
        """Elements [start, end) of tensor `key` flattened (default all; 1-D unless the whole tensor is
        read, which keeps its shape). crc32: checked when the whole tensor is read.
        Raises CheckpointFileError for an unknown key, a range outside the tensor or a CRC mismatch."""
        self.info(key)
        dtype, shape, begin, _ = self.tensors[key]
        numel = math.prod(shape)
        whole = start == 0 and end is None
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise CheckpointFileError(f"{self.path}: range [{start}, {end}) is outside tensor {key!r} "
                                      f"of {numel} elements")
        out = torch.empty(end - start, dtype=dtype)
        if end > start:
            self._f.seek(self._base + begin + start * dtype.itemsize)
            buf = out.view(torch.uint8).numpy()
            if self._f.readinto(buf) != buf.nbytes:
                raise CheckpointFileError(f"checkpoint file {self.path} is truncated inside tensor {key!r}")
            if whole and crc32 is not None and zlib.crc32(buf) != crc32:
                raise CheckpointFileError(f"checkpoint file {self.path} is corrupt: tensor {key!r} fails its "
                                          "CRC-32 check")
        return out.view(shape) if whole else out

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- JSON values that may contain tensors -------------------------------------------------------------
_MARKERS = ("__tensor__", "__tuple__", "__items__")


def encode_json(obj: Any, tensors: dict[str, torch.Tensor], *, prefix: str, path: str = "") -> Any:
    """A JSON-serialisable form of `obj`. Tensors are moved into `tensors` under `prefix/<n>` and
    replaced by {"__tensor__": key}; tuples become {"__tuple__": [...]}, dicts with non-string keys
    {"__items__": [[k, v], ...]}. Accepts None, bool, int, float, str, lists, tuples, dicts,
    torch tensors and numpy scalars. Raises TypeError naming the path of anything else (objects
    are never pickled into a checkpoint)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if torch.is_tensor(obj):
        key = f"{prefix}/{len(tensors)}"
        tensors[key] = obj.detach().cpu()
        return {"__tensor__": key}
    if isinstance(obj, (list, tuple)):
        items = [encode_json(v, tensors, prefix=prefix, path=f"{path}[{i}]") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(m in obj for m in _MARKERS):
            return {k: encode_json(v, tensors, prefix=prefix, path=f"{path}[{k!r}]") for k, v in obj.items()}
        return {"__items__": [[encode_json(k, tensors, prefix=prefix, path=f"{path} key {k!r}"),
                               encode_json(v, tensors, prefix=prefix, path=f"{path}[{k!r}]")] for k, v in obj.items()]}
    if type(obj).__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return obj.item()
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    raise TypeError(f"{path or 'value'}: cannot store an object of type {kind} "
                    "in a checkpoint: only None, bool, int, float, str, lists, tuples, dicts and torch tensors are "
                    "stored (nothing is pickled). Convert it to those, e.g. a dict of plain values")


def decode_json(obj: Any, get_tensor: Callable[[str], torch.Tensor]) -> Any:
    """Invert `encode_json`; `get_tensor(key)` returns a stored tensor."""
    if isinstance(obj, list):
        return [decode_json(v, get_tensor) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return get_tensor(obj["__tensor__"])
        if set(obj) == {"__tuple__"}:
            return tuple(decode_json(v, get_tensor) for v in obj["__tuple__"])
        if set(obj) == {"__items__"}:
            return {decode_json(k, get_tensor): decode_json(v, get_tensor) for k, v in obj["__items__"]}
        return {k: decode_json(v, get_tensor) for k, v in obj.items()}
    return obj


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes in "5GB" (10**9, as Hugging Face counts), "500MiB" (2**20), "2048" or an int.
    Raises ValueError for anything else or a size < 1."""
    if isinstance(text, int):
        value = text
    else:
        s = text.strip().upper().replace(" ", "")
        num = s.rstrip("KMGTIB")
        unit = s[len(num):]
        if unit not in _UNITS or not num:
            raise ValueError(f"cannot read size {text!r}: use a number of bytes or e.g. 500MB, 5GB, 2GiB")
        value = int(float(num) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return value
