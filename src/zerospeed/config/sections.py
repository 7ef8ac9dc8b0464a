"""Smaller top-level sections: logging/monitoring, profiling, activation checkpointing, AIO, checkpoint.

DeepSpeed reads several of these (``activation_checkpointing``, ``flops_profiler``, ``aio``,
``checkpoint``) with plain ``dict.get`` and ignores unknown keys; zerospeed validates them
strictly like every other section.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from ._base import ConfigModel
from .errors import ConfigIssue
from .keys import unsupported_message

__all__ = [
    "CommsLoggerConfig",
    "ActivationCheckpointingConfig",
    "FlopsProfilerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "CSVMonitorConfig",
    "AIOConfig",
    "CheckpointConfig",
    "CheckpointParallelWriteConfig",
]


class CommsLoggerConfig(ConfigModel):
    """``comms_logger``: count and time collectives (summary via the comms logger)."""

    enabled: bool = False
    verbose: bool = False
    """Log every collective as it happens (default false)."""
    prof_all: bool = True
    """Profile every collective (default true); false = only those in prof_ops."""
    prof_ops: list[str] = Field(default_factory=list)
    """Collective names to profile when prof_all is false, e.g. ["all_reduce", "all_gather"]."""
    debug: bool = False
    """Include the calling function's name in the log records."""


class ActivationCheckpointingConfig(ConfigModel):
    """``activation_checkpointing``: options for ``zerospeed.checkpointing.checkpoint``.

    Takes effect only where model code calls the checkpointing API; it checkpoints nothing alone.
    """

    partition_activations: bool = False
    """Split checkpointed activations across model-parallel ranks."""
    cpu_checkpointing: bool = False
    """Move checkpointed activations to CPU (needs partition_activations in DeepSpeed)."""
    contiguous_memory_optimization: bool = False
    """Copy checkpoints into one contiguous buffer (needs number_checkpoints)."""
    number_checkpoints: Optional[int] = Field(None, ge=1)
    """Number of checkpoints per forward, for the contiguous buffer."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the device at each checkpoint boundary (debugging/timing)."""
    profile: bool = False
    """Time the checkpointing forward/backward functions."""


class FlopsProfilerConfig(ConfigModel):
    """``flops_profiler``: profile one training step. Enabling it also turns on wall_clock_breakdown."""

    enabled: bool = False
    recompute_fwd_factor: float = Field(0.0, ge=0.0)
    """Extra forward passes counted for activation recomputation (0.0 none, 1.0 full)."""
    profile_step: int = 1
    """Global step to profile (default 1)."""
    module_depth: int = -1
    """Module depth of the per-module report (-1 = all)."""
    top_modules: int = 1
    """Number of top modules shown in the aggregated report."""
    detailed: bool = True
    """Print the per-module breakdown."""
    output_file: Optional[str] = None
    """File for the report (None = stdout)."""


class TensorBoardConfig(ConfigModel):
    """``tensorboard``: write Train/Samples/* scalars with torch.utils.tensorboard."""

    enabled: bool = False
    output_path: str = ""
    """Directory for event files ("" = the current directory's runs/)."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory (run name) under output_path."""


class WandbConfig(ConfigModel):
    """``wandb``: log Train/Samples/* scalars to Weights & Biases."""

    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class CSVMonitorConfig(ConfigModel):
    """``csv_monitor``: write Train/Samples/* scalars to CSV files."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class AIOConfig(ConfigModel):
    """``aio``: asynchronous I/O for NVMe offload (block_size in bytes)."""

    block_size: int = Field(1_048_576, gt=0)
    """I/O request size in bytes (default 1 MiB)."""
    queue_depth: int = Field(8, gt=0)
    """Outstanding requests per thread (default 8)."""
    thread_count: int = Field(1, gt=0)
    """I/O threads (default 1)."""
    intra_op_parallelism: int = Field(1, gt=0)
    """Threads per I/O operation (default 1)."""
    single_submit: bool = False
    """Submit requests one by one instead of in batches."""
    overlap_events: bool = True
    """Overlap submission and completion of requests."""
    use_gds: bool = False
    """GPUDirect Storage (CUDA only; not available on this backend)."""


class CheckpointParallelWriteConfig(ConfigModel):
    """``checkpoint.parallel_write``."""

    pipeline_stage: bool = False
    """Write pipeline-stage checkpoints in parallel."""


class CheckpointConfig(ConfigModel):
    """``checkpoint``: checkpoint tag validation and loading options."""

    tag_validation: Literal["Warn", "Ignore", "Fail"] = "Warn"
    """Check that all ranks save under the same tag: "Warn" (default), "Ignore" or "Fail"
    (any case accepted, stored capitalised)."""
    load_universal: bool = False
    """Load a DeepSpeed universal checkpoint."""
    use_node_local_storage: bool = False
    """Each node saves/loads its own copy (node-local disks)."""
    parallel_write: CheckpointParallelWriteConfig = Field(default_factory=CheckpointParallelWriteConfig)
    writer: Optional[dict[str, Any]] = None
    """DeepSpeed's checkpoint writer options (not supported yet; must be absent or null)."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _capitalise(cls, v: Any) -> Any:
        return v.strip().capitalize() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self) -> CheckpointConfig:
        if self.writer is not None:
            raise ConfigIssue.at("writer", unsupported_message("checkpoint.writer"))
        return self
