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
from .budget import RankBudget
from .hostmem import return_freed_memory_to_os
from .policy import OffloadPolicy
from .preflight import check_nvme_path, check_resources
from .swap import SwapSpace, clear_stale

__all__ = ["OffloadContext"]

_log = logging.getLogger("zerospeed")


class OffloadContext:
    """One rank's offload resources. policy: the `OffloadPolicy`; aio: the `AsyncIO` engine (None
    without NVMe); swaps: {"optimizer" | "param": SwapSpace}; budget: the predicted `RankBudget`.
    close() removes the swap files."""

    def __init__(self, policy: OffloadPolicy, aio: AsyncIO | None, swaps: dict[str, SwapSpace]):
        self.policy, self.aio, self.swaps = policy, aio, swaps
        self.budget: RankBudget | None = None  # the prediction the pre-flight checked (create)

    @classmethod
    def create(cls, policy: OffloadPolicy, aio_cfg, *, rank: int, local_ranks: int, budget: RankBudget,
               clear_stale_files: bool = True, disk_credit: dict | None = None) -> OffloadContext:
        """Pre-flight (nvme_path usable; this node's RAM and disks hold `local_ranks` times `budget`, the
        rank's predicted host and disk bytes from `budget.rank_budget`; with `clear_stale_files` (one rank
        per node) swap files of dead runs are removed first; `disk_credit`: bytes on disk the run frees as
        it starts, see `check_resources`), then open the swap spaces. Raises
        OffloadResourceError with the numbers, what the host bytes are made of, and the fix."""
        paths = {}
        for what, device, path in (("optimizer", policy.optimizer, policy.optimizer_nvme_path),
                                   ("param", policy.param, policy.param_nvme_path)):
            if device == "nvme":
                paths[what] = check_nvme_path(path, key=f"zero_optimization.offload_{what}.nvme_path")
        if clear_stale_files:
            for p in set(paths.values()):
                clear_stale(p)
        disk: dict = {}
        for what, n in budget.disk.items():
            where = paths["param" if what == "param" else "optimizer"]
            disk[where] = disk.get(where, 0) + n
        host = budget.host_total
        pinned = sum(budget.host.get(k, 0) for k in ("param_pool", "optimizer")) \
            if policy.pin_memory and torch.accelerator.is_available() else 0  # the I/O buffers are pinned
        check_resources(host_bytes=host - pinned, pinned_bytes=pinned, disk_bytes=disk, local_ranks=local_ranks,
                        disk_credit=disk_credit,
                        what=f"{policy.describe()} (per rank: {budget.describe()}, plus activations)")
        return_freed_memory_to_os()  # host RAM is what offload saves: let freed tensors leave the RSS
        aio = AsyncIO.from_config(aio_cfg) if paths else None
        swaps = {w: SwapSpace(p, rank=rank, aio=aio) for w, p in paths.items()}
        ctx = cls(policy, aio, swaps)
        ctx.budget = budget
        return ctx

    def close(self) -> None:
        """Remove this rank's swap files and stop the I/O threads (idempotent)."""
        for s in self.swaps.values():
            s.close()
        if self.aio is not None:
            self.aio.close()

    def disk_bytes(self) -> int:
        return sum(s.bytes_on_disk() for s in self.swaps.values())
