"""Where ZeRO's model states live: the offload policy (a frozen dataclass built from the config).

ZeRO-Offload (Ren et al. 2021, §4) keeps the fp32 master weights and optimizer states in host
memory and runs the optimizer step there; ZeRO-Infinity (Rajbhandari et al. 2021, §5) moves them,
and the partitioned parameters, further down to NVMe. The policy only says *where*; `OffloadContext`
(`context.py`) owns the I/O resources, `SwappedOptimizer` (`optimizer.py`) and `ParamSwapper`
(`params.py`) do the moving, and the ZeRO strategies compose them (DESIGN.md rule 8).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["OffloadPolicy"]


@dataclass(frozen=True)
class OffloadPolicy:
    """Placement of model states beyond the compute device.

    optimizer: "none" | "cpu" | "nvme" (`offload_optimizer.device`): where the fp32 master weights and
    optimizer states live; with "cpu" or "nvme" the optimizer step runs on the host.
    param: "none" | "cpu" | "nvme" (`offload_param.device`, stage 3 only): where each rank's parameter
    shard (in the parameter dtype) lives between all-gathers.
    optimizer_nvme_path / param_nvme_path: directories for the swap files.
    pin_memory: page-locked host buffers (only used when an accelerator exists).
    sub_group_size: elements per optimizer-step tile when the optimizer states are on NVMe (the step
    streams one tile at a time; at most two tiles of master + states are in RAM).
    pipeline: read the next tile / write the previous one while the current one steps
    (`pipeline_read` or `pipeline_write`); without it each tile is read, stepped and written in turn.
    param_buffer_count / param_buffer_size: the pool of host buffers NVMe parameter shards are read
    into (count, elements each); a gather unit's shard must fit one buffer.
    max_in_cpu: elements of NVMe-offloaded parameter shards kept resident in host memory.
    super_offload: step each optimizer tile during the boundary backward as its gradient is reduced
    (`offload_optimizer.super_offload`; stage 3, optimizer on NVMe; only when the step needs no global
    quantity: no gradient clipping, no overflow check), see `backward_steps.py`.
    """

    optimizer: str = "none"
    param: str = "none"
    optimizer_nvme_path: Path | None = None
    param_nvme_path: Path | None = None
    pin_memory: bool = True
    sub_group_size: int = 1_000_000_000
    pipeline: bool = False
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    super_offload: bool = False

    @classmethod
    def from_config(cls, zero_cfg) -> OffloadPolicy:
        """From the validated `zero_optimization` section (its offload_optimizer / offload_param blocks)."""
        opt, par = zero_cfg.offload_optimizer, zero_cfg.offload_param
        kw = {"sub_group_size": int(zero_cfg.sub_group_size)}
        if opt is not None and opt.enabled:
            kw.update(optimizer=opt.device, optimizer_nvme_path=opt.nvme_path, pin_memory=opt.pin_memory,
                      pipeline=opt.pipeline, super_offload=opt.super_offload)
        if par is not None and par.enabled:
            kw.update(param=par.device, param_nvme_path=par.nvme_path, param_buffer_count=par.buffer_count,
                      param_buffer_size=par.buffer_size, max_in_cpu=par.max_in_cpu)
            kw["pin_memory"] = kw.get("pin_memory", True) and par.pin_memory
        return cls(**kw)

    @property
    def enabled(self) -> bool:
        return self.optimizer != "none" or self.param != "none"

    @property
    def optimizer_on_host(self) -> bool:
        """The master weights and optimizer states are off the compute device (host RAM or NVMe)."""
        return self.optimizer != "none"

    @property
    def nvme(self) -> bool:
        return "nvme" in (self.optimizer, self.param)

    def describe(self) -> str:
        return f"offload_optimizer={self.optimizer}, offload_param={self.param}"
