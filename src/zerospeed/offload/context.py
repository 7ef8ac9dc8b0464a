"""The I/O resources of one rank's offload: pre-flight checks, the async-I/O engine and swap spaces.

Built by `zerospeed.initialize` before any model state is allocated (`OffloadContext.create`):
it checks `nvme_path`, clears swap directories left by killed runs, compares what this rank will
need (host RAM, pinned memory, disk) with what the node has, and only then opens the swap spaces.
The strategies receive it and build their `SwappedOptimizer` / `ParamSwapper` from it.
"""
from __future__ import annotations

import logging

import torch

from .aio import AsyncIO
from .hostmem import return_freed_memory_to_os
from .policy import OffloadPolicy
from .preflight import check_nvme_path, check_resources
from .swap import SwapSpace, clear_stale

__all__ = ["OffloadContext", "estimate_needs"]

_log = logging.getLogger("zerospeed")


def estimate_needs(policy: OffloadPolicy, *, numel: int, world: int, param_bytes: int,
                   largest_unit: int | None = None, states: int = 2, stage: int = 3) -> dict[str, dict]:
    """What one rank will need, in bytes: {"host": n, "pinned": n, "disk": {"optimizer" | "param": n}}.

    numel: trainable parameters Ψ (elements); world: dp ranks N; param_bytes: bytes per element of
    the parameter dtype; largest_unit: elements of the largest stage-3 gather unit (default Ψ);
    states: elementwise optimizer states per element (Adam: 2). The fp32 masters and states take
    (1 + states) x 4 x Ψ/N bytes wherever the optimizer offload puts them; at stage 3 with the
    optimizer on NVMe the fp32 gradients go there too (4 x Ψ/N bytes, `SwappedGrads`).
    """
    shard = -(-numel // world)
    host, disk = 0, {}
    opt_bytes = (1 + states) * 4 * shard
    if policy.optimizer == "cpu":
        host += opt_bytes
    elif policy.optimizer == "nvme":
        tile = min(policy.sub_group_size, shard)
        host += (2 if policy.pipeline else 1) * (1 + states) * 4 * tile
        disk["optimizer"] = opt_bytes + (4 * shard if stage == 3 else 0)
    if policy.param == "nvme":
        unit = -(-(largest_unit or numel) // world)
        host += max(policy.param_buffer_count, 2) * min(policy.param_buffer_size, unit) * param_bytes
        disk["param"] = shard * param_bytes
    pinned = host if policy.pin_memory and torch.accelerator.is_available() else 0
    return {"host": host, "pinned": pinned, "disk": disk}


class OffloadContext:
    """One rank's offload resources. policy: the `OffloadPolicy`; aio: the `AsyncIO` engine (None
    without NVMe); swaps: {"optimizer" | "param": SwapSpace}. close() removes the swap files."""

    def __init__(self, policy: OffloadPolicy, aio: AsyncIO | None, swaps: dict[str, SwapSpace]):
        self.policy, self.aio, self.swaps = policy, aio, swaps

    @classmethod
    def create(cls, policy: OffloadPolicy, aio_cfg, *, rank: int, local_ranks: int, numel: int, world: int,
               param_bytes: int, largest_unit: int | None = None, clear_stale_files: bool = True,
               stage: int = 3) -> OffloadContext:
        """Pre-flight (nvme_path usable, enough RAM / pinned memory / disk for `local_ranks` ranks on
        this node; with `clear_stale_files` (one rank per node) swap files of dead runs are removed
        first), then open the swap spaces. Raises OffloadResourceError with the numbers and the fix."""
        paths = {}
        for what, device, path in (("optimizer", policy.optimizer, policy.optimizer_nvme_path),
                                   ("param", policy.param, policy.param_nvme_path)):
            if device == "nvme":
                paths[what] = check_nvme_path(path, key=f"zero_optimization.offload_{what}.nvme_path")
        if clear_stale_files:
            for p in set(paths.values()):
                clear_stale(p)
        needs = estimate_needs(policy, numel=numel, world=world, param_bytes=param_bytes, largest_unit=largest_unit,
                               stage=stage)
        disk: dict = {}
        for what, n in needs["disk"].items():
            disk[paths[what]] = disk.get(paths[what], 0) + n
        check_resources(host_bytes=needs["host"], pinned_bytes=needs["pinned"], disk_bytes=disk,
                        local_ranks=local_ranks, what=policy.describe())
        return_freed_memory_to_os()  # host RAM is what offload saves: let freed tensors leave the RSS
        aio = AsyncIO.from_config(aio_cfg) if paths else None
        swaps = {w: SwapSpace(p, rank=rank, aio=aio) for w, p in paths.items()}
        return cls(policy, aio, swaps)

    def close(self) -> None:
        """Remove this rank's swap files and stop the I/O threads (idempotent)."""
        for s in self.swaps.values():
            s.close()
        if self.aio is not None:
            self.aio.close()

    def disk_bytes(self) -> int:
        return sum(s.bytes_on_disk() for s in self.swaps.values())
