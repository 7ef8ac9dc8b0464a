"""What `initialize` decides for a `PipelineModule`: whether the model is one, its schedule, whether its backward
is split, and what this version of the pipeline engine does not run (checked before any process group)."""
from __future__ import annotations

from ..config import ConfigError, ZeroSpeedConfig
from ..pipe.schedule import build_schedule


def is_pipeline(model) -> bool:
    from ..pipe import PipelineModule

    return isinstance(model, PipelineModule)


def split_backward(cfg: ZeroSpeedConfig, model) -> bool:
    """`pipeline.split_backward` resolved: "auto" splits where it measured faster on this CPU - gradients kept
    in `.grad` in the parameters' dtype across micro-batches (no fp16/bf16, ZeRO 0 or 1), so a linear layer's
    weight gradient accumulates there in one GEMM - and no activation checkpointing (see the config key)."""
    split = cfg.pipeline.split_backward
    if split != "auto":
        return split
    return cfg.precision == "fp32" and cfg.zero_optimization.stage <= 1 and not model.activation_checkpoint_interval


def pipeline_schedule(cfg: ZeroSpeedConfig, model) -> str:
    """The config's pipeline.schedule; unset: "dualpipev" for a DualPipeVModule (DeepSpeed runs it with its
    DualPipeVEngine), else "1f1b"."""
    from ..pipe import DualPipeVModule

    if "schedule" not in cfg.pipeline.model_fields_set and isinstance(model, DualPipeVModule):
        return "dualpipev"
    return cfg.pipeline.schedule


def check_pipeline(cfg: ZeroSpeedConfig, model, mpu) -> None:
    """What this version of the pipeline engine runs; NotImplementedError naming anything else."""
    stage = cfg.zero_optimization.stage
    if stage >= 3:
        raise NotImplementedError(f"zero_optimization.stage={stage} with a PipelineModule is not supported: every "
                                  "micro-batch would gather each stage's parameters again; use stage 0, 1 or 2")
    if mpu is not None or cfg.tensor_parallel.size > 1:
        raise NotImplementedError("a PipelineModule with initialize(mpu=...) or tensor_parallel.autotp_size is not "
                                  "supported yet: the pipeline builds its own (pipe, data) mesh")
    try:
        build_schedule(pipeline_schedule(cfg, model), model.num_stages, cfg.gradient_accumulation_steps,
                       chunks=model.chunks, layout=model.chunk_layout)
    except ValueError as e:
        raise ConfigError(f"pipeline.schedule: {e}") from None
    stages = cfg.pipeline.stages
    if stages != "auto" and stages != model.num_stages:
        raise ConfigError(f"pipeline.stages={stages} but the PipelineModule has num_stages={model.num_stages}; "
                          "set pipeline.stages to \"auto\" (the module decides, as in DeepSpeed) or make them agree")
