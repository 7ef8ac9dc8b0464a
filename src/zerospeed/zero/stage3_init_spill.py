"""`zerospeed.zero.Init(remote_device="nvme")`: Init's parameter slices on NVMe until a strategy takes them.

Without it, a model built under `Init` keeps each rank's fp32 slices in host memory (4 bytes x Ψ/N)
until `zerospeed.initialize` hands them to the stage-3 units, which (with `offload_param` on NVMe)
write them to their own swap files one unit at a time. At ZeRO-Infinity sizes those slices alone
exceed the RAM (a 4B-parameter model at 2 ranks: 8 GB per rank), so, as DeepSpeed's
`zero.Init(remote_device="nvme", config_dict_or_path=...)` does, each slice is written to
`zero_optimization.offload_param.nvme_path` as soon as it is cut and read back when it is used
(an op inside `Init`, `GatheredParameters`, or the strategy's all-gather of the full value); the file
of a parameter the strategy took over is deleted at once, so the disk holds each slice once.
"""
from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import torch

from ..offload.aio import HOST, AsyncIO, aligned_empty
from ..offload.hostmem import return_freed_memory_to_os
from ..offload.preflight import check_nvme_path
from ..offload.swap import SwapSpace

__all__ = ["InitSpill", "nvme_path_from_config", "spilled_bytes"]

_KEY = "zero_optimization.offload_param.nvme_path"
_LIVE: "weakref.WeakSet[InitSpill]" = weakref.WeakSet()


def spilled_bytes() -> dict[str, int]:
    """{nvme_path: bytes} of the slices this process's Init spills hold now (the pre-flight counts them
    as free: the strategy deletes each as it takes the parameter over)."""
    out: dict[str, int] = {}
    for spill in list(_LIVE):
        out[str(spill.nvme_path)] = out.get(str(spill.nvme_path), 0) + spill.nbytes()
    return out


def nvme_path_from_config(config_dict_or_path, config=None) -> Path:
    """`zero_optimization.offload_param.nvme_path` of a DeepSpeed-style config (dict, or path to a JSON
    file), checked to be a writable directory. Raises ValueError when no config or no such key is
    given, OffloadResourceError when the directory is unusable."""
    cfg = config if config is not None else config_dict_or_path
    if isinstance(cfg, (str, os.PathLike)):
        cfg = json.loads(Path(cfg).read_text())
    path = ((cfg or {}).get("zero_optimization") or {}).get("offload_param", {}).get("nvme_path") \
        if isinstance(cfg, dict) else None
    if path is None:
        raise ValueError('zerospeed.zero.Init(remote_device="nvme") writes the slices to the NVMe directory of the '
                         f'config: pass config_dict_or_path=<your ds_config> with {_KEY} set (the same config you '
                         'give zerospeed.initialize)')
    return check_nvme_path(path, key=_KEY)


class InitSpill:
    """One rank's Init slices in a swap directory under `nvme_path` (synchronous I/O, one file per slice).

    put(key, local) writes a slice; get(key) reads it back (host tensor; the caller moves it to its
    device); drop(key) deletes it. The directory is removed when the last slice is dropped after
    `detach()` (Init exited), or at exit.
    """

    def __init__(self, nvme_path: Path, *, rank: int):
        return_freed_memory_to_os()  # full values freed after their slices were cut must leave the RSS
        self.aio = AsyncIO()
        self.nvme_path = nvme_path
        self.swap = SwapSpace(nvme_path, rank=rank, aio=self.aio)
        self.meta: dict[str, tuple[int, torch.dtype]] = {}
        self.detached = False
        _LIVE.add(self)

    def nbytes(self) -> int:
        """Bytes of the slices on disk now."""
        return sum(n * dtype.itemsize for n, dtype in self.meta.values())

    def put(self, key: str, local: torch.Tensor) -> None:
        buf = aligned_empty(local.numel(), local.dtype)
        buf.copy_(local.reshape(-1))
        self.swap.write(key, buf).wait()
        self.meta[key] = (local.numel(), local.dtype)

    def get(self, key: str) -> torch.Tensor:
        numel, dtype = self.meta[key]
        buf = aligned_empty(numel, dtype)
        self.swap.read(key, buf).wait()
        return buf if buf.device == HOST else buf.to(HOST)

    def drop(self, key: str) -> None:
        if self.meta.pop(key, None) is not None and not self.swap.closed:
            self.swap.remove(key)
        if self.detached and not self.meta:
            self.close()

    def detach(self) -> None:
        """Init exited: close once nothing is left."""
        self.detached = True
        if not self.meta:
            self.close()

    def close(self) -> None:
        _LIVE.discard(self)
        self.swap.close()
        self.aio.close()
