"""``pipeline``: DeepSpeed's pipeline block, plus the schedule the pipeline engine runs (an extension).

DeepSpeed 0.19.8 keeps this block as a plain dict (``config.py: get_pipeline_config``) with the defaults
below; its PipelineEngine reads ``pipe_partitioned`` / ``grad_partitioned`` (split activations and their
gradients over the tensor-parallel group, which zerospeed does not combine with pipelines yet) and
nothing else: the stages and the partition come from the `PipelineModule`. zerospeed reads them the same
way and checks ``stages``, when it is a number, against the module's ``num_stages``.

``schedule`` (zerospeed's own key) picks the order of forward and backward passes
(`zerospeed.pipe.schedule`): ``"1f1b"`` (DeepSpeed's ``TrainSchedule``, the default), ``"gpipe"`` and
``"zb_h1"`` (zero bubble: the backward split into input- and weight-gradient passes, Qi et al. 2024 §3.1) on
a module with one chunk per rank; ``"interleaved_1f1b"`` (Narayanan et al. 2021 §2.2) on
``PipelineModule(..., chunks=2 or more)``; ``"zb_v"`` (Qi et al. 2024 §6) on
``PipelineModule(..., chunks=2, chunk_layout="v")`` (or a ``DualPipeVModule``); ``"dualpipev"`` (DeepSeek-V3's
DualPipeV with its zero-bubble weight-gradient deferral) on the same V layout, the default for a
``DualPipeVModule`` as DeepSpeed's DualPipeVEngine. `zerospeed.initialize` checks the module fits.
``split_backward`` (also zerospeed's) computes every backward as those two passes back to back.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import Field

from ._base import ConfigModel

__all__ = ["PipelineConfig", "PIPELINE_SCHEDULES"]

#: the schedules the pipeline engine runs (names of `zerospeed.pipe.schedule.candidate_schedules`)
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "zb_h1", "interleaved_1f1b", "zb_v", "dualpipev")


class PipelineConfig(ConfigModel):
    """``pipeline``: read only with a `PipelineModule` (``zerospeed.initialize(model=pipeline_module)``)."""

    stages: Union[Literal["auto"], int] = "auto"
    """Number of pipeline stages: "auto" (the PipelineModule's num_stages) or that same number."""
    partition: str = "best"
    """DeepSpeed's key, unused by its engine as by zerospeed's: the PipelineModule's partition_method decides."""
    seed_layers: bool = False
    """DeepSpeed's key, unused by its engine: pass seed_layers= to the PipelineModule."""
    activation_checkpoint_interval: int = Field(0, ge=0)
    """DeepSpeed's key, unused by its engine: pass activation_checkpoint_interval= to the PipelineModule."""
    pipe_partitioned: bool = True
    """Split activations sent between stages over the tensor-parallel group (no effect without one)."""
    grad_partitioned: bool = True
    """Split activation gradients over the tensor-parallel group (no effect without one)."""
    schedule: Literal["1f1b", "gpipe", "zb_h1", "interleaved_1f1b", "zb_v", "dualpipev"] = "1f1b"
    """zerospeed extension: the pipeline schedule (see the module docstring); unset with a DualPipeVModule:
    "dualpipev"."""
    split_backward: Union[Literal["auto"], bool] = "auto"
    """zerospeed extension: run a schedule's ordinary backward as its input-gradient pass followed at once by its
    weight-gradient pass (`zerospeed.pipe.backward_split`; the order of work is the schedule's). True / False:
    always / never (autograd's fused backward). The split computes a linear layer's weight gradient as one GEMM
    accumulating into `.grad` instead of a product plus autograd's separate accumulation pass, which pays where
    `.grad` persists across micro-batches; "auto" splits only there: fp32 (no fp16/bf16) at ZeRO 0 or 1, and no
    activation checkpointing (whose recomputation the split does not speed up). Measured on this CPU (one
    process, an 8-layer MLP stage, 8 micro-batches, interleaved medians): fp32 ZeRO 0/1 0.87-0.94x the fused
    step time; bf16 ZeRO 0/1 and fp32 ZeRO 2 0.98-1.01x; bf16 ZeRO 2 1.09-1.16x (slower; 1.03-1.06x since
    ``retain_freed_host_memory`` stopped its freed memory being faulted in again every micro-batch)."""
