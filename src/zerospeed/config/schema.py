"""``ZeroSpeedConfig``: the whole ds_config, validated, with "auto" and the batch triple resolved.

Build it with ``load_config(source, dp_world_size=..., client_optimizer=..., model=...)``; what each
"auto" value becomes is listed in ``config/auto.py``. Validating a dict
directly also works: ``ZeroSpeedConfig.model_validate(d, context={"dp_world_size": 2})`` (but
raises pydantic's ValidationError instead of ConfigError).
"""
from __future__ import annotations

import warnings
from typing import Any, Literal, Optional, Union

from pydantic import Field, PrivateAttr, field_validator, model_validator

from ._base import ConfigModel, is_auto
from .auto import resolve_precision_autos
from .batch import GA, MB, TB, resolve_batch
from .errors import ConfigDeprecationWarning, ConfigError, ConfigIssue
from .keys import split_top_level_unsupported
from .optimizer import OptimizerConfig, client_hyperparam
from .precision import BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig
from .scheduler import SchedulerConfig
from .sections import (
    ActivationCheckpointingConfig,
    AIOConfig,
    CheckpointConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from .expert_parallel import ExpertParallelConfig
from .pipeline import PipelineConfig
from .tensor_parallel import TensorParallelConfig, tp_batch_problems
from .zero import ZeroConfig

__all__ = ["ZeroSpeedConfig", "DEFAULT_STEPS_PER_PRINT"]

#: steps_per_print used when the config leaves it unset (None).
DEFAULT_STEPS_PER_PRINT = 10

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _optimizer_lr(data: dict[str, Any], client: Any) -> Any:
    """The optimizer lr the config implies (for scheduler warmup_max_lr: "auto"), or None."""
    opt = data.get("optimizer")
    lr = opt.get("params", {}).get("lr") if isinstance(opt, dict) and isinstance(opt.get("params"), dict) else None
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        return lr
    found, value = client_hyperparam(client, "lr")
    return value if found and isinstance(value, (int, float)) else None


class ZeroSpeedConfig(ConfigModel):
    """A validated ds_config (DeepSpeed 0.19.8 keys and defaults). Frozen.

    Batch fields are resolved ints: ``train_batch_size == train_micro_batch_size_per_gpu *
    gradient_accumulation_steps * dp_world_size`` (``dp_world_size`` is the value it was
    resolved with).
    """

    train_batch_size: int = Field(gt=0)
    """Samples per optimizer step over all data-parallel ranks ("auto" = derived)."""
    train_micro_batch_size_per_gpu: int = Field(gt=0)
    """Samples per rank per forward/backward ("auto" = derived)."""
    gradient_accumulation_steps: int = Field(gt=0)
    """Micro-steps per optimizer step ("auto" = derived)."""
    managed_gradient_accumulation: bool = True
    """True (default): ``engine.step()`` is a no-op except at the accumulation boundary. False:
    every ``step()`` is a boundary and the user owns the accumulation."""
    optimizer: Optional[OptimizerConfig] = None
    """The optimizer to build when the client passes none."""
    scheduler: Optional[SchedulerConfig] = None
    """The LR schedule, stepped once per optimizer step."""
    gradient_clipping: float = Field(1.0, ge=0.0)
    """Max global L2 norm of the gradients, applied at the step after unscaling. 0 disables.
    Default **1.0**, as DeepSpeed 0.19 (#8068); older DeepSpeed defaulted to 0.0 (no clipping), so
    an old config without this key now clips. "auto" = 1.0, which is also what the Hugging Face
    Trainer fills in with its default ``max_grad_norm``."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bf16 mixed precision; the old key ``bfloat16`` is accepted with a warning."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    steps_per_print: Optional[int] = Field(None, gt=0)
    """Log every N optimizer steps. None (DeepSpeed's default) = every 10 steps in zerospeed
    (see ``effective_steps_per_print``)."""
    wall_clock_breakdown: bool = False
    """Time forward/backward/step (turned on by flops_profiler.enabled too)."""
    memory_breakdown: bool = False
    """Log memory usage at each step."""
    dump_state: bool = False
    """Print the engine state after initialisation."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch of the engine-built dataloader."""
    disable_python_gc: bool = False
    """Disable Python's automatic cyclic GC during training (collect explicitly)."""
    seed: Optional[int] = None
    """zerospeed extension (not a DeepSpeed key): if set, ``initialize`` seeds torch with it and
    the engine-built dataloader shuffles with it. None = leave the RNGs alone."""
    data_parallel_size: Optional[int] = Field(None, ge=1)
    """The data-parallel ranks (world / (tensor x pipeline parallel)); checked against the launch. DeepSpeed reads
    it only together with sequence_parallel_size (which zerospeed supports at 1 only)."""
    retain_freed_host_memory: Union[Literal["auto"], bool] = "auto"
    """zerospeed extension: set glibc malloc's mmap and trim thresholds (32 MiB, 1 GiB) at ``initialize`` so
    memory a step frees is reused by the next instead of returned to the kernel and faulted in again
    (`zerospeed.runtime.host_malloc`; process-wide; the resident set then stays near its peak between steps).
    "auto" (default): when the model trains on the host (no accelerator) without parameter or optimizer offload
    (whose runs budget host memory); True / False: always / never. Nothing changes off glibc or when the
    environment already tunes malloc (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``)."""
    prescale_gradients: bool = False
    """Divide gradients by gradient_predivide_factor before the all-reduce (rest after)."""
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    """Pre-division factor used with prescale_gradients (default 1.0)."""
    communication_data_type: Optional[Literal["fp32", "fp16", "bf16"]] = None
    """dtype of gradient communication; None = the gradients' dtype."""
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """"mean" (default) averages gradients over data-parallel ranks; "sum" sums them (not with
    ZeRO stage 3)."""
    zero_allow_untested_optimizer: bool = False
    """Allow a client optimizer outside the ZeRO-tested list."""
    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require the engine's CPU optimizer (not a client one)."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    aio: AIOConfig = Field(default_factory=AIOConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    """AutoEP: the experts of an unmodified Hugging Face MoE model spread over autoep_size ranks."""
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    vocabulary_size: Optional[int] = Field(None, gt=0)
    """Model vocabulary size; a warning is issued when it is not a multiple of 8."""
    log_level: Optional[str] = None
    """Logging level name (debug, info, warning, error, critical); None = unchanged."""

    _dp_world_size: int = PrivateAttr(default=1)

    @classmethod
    def _prepare(cls, data: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        issues: list[tuple[tuple, str]] = split_top_level_unsupported(data)
        if "bfloat16" in data:
            if "bf16" in data:
                issues.append((("bfloat16",), "deprecated alias given together with 'bf16'; keep only 'bf16'"))
            else:
                warnings.warn("'bfloat16' is a deprecated key; use 'bf16'", ConfigDeprecationWarning, stacklevel=2)
                data["bf16"] = data.pop("bfloat16")
        zero = data.get("zero_optimization")
        if isinstance(zero, bool):
            warnings.warn("'zero_optimization: true/false' is a deprecated format; use "
                          '"zero_optimization": {"stage": N}', ConfigDeprecationWarning, stacklevel=2)
            data["zero_optimization"] = {"stage": 1 if zero else 0}
            if zero and "allgather_size" in data:
                data["zero_optimization"]["allgather_bucket_size"] = data.pop("allgather_size")
        resolve_precision_autos(data, context.get("model_hints"))
        for key in ("gradient_allreduce_op", "communication_data_type", "log_level"):
            if isinstance(data.get(key), str) and not is_auto(data[key]):
                data[key] = data[key].strip().lower()

        # load_config passes a list in the context to collect these problems together with the
        # field errors found later; without it they are raised at once.
        sink = context.get("deferred_issues")
        dp = context.get("dp_world_size", 1)
        raw = [None if is_auto(data.get(k)) else data.get(k) for k in (TB, MB, GA)]
        tp_block = data.get("tensor_parallel")
        tp = tp_block.get("autotp_size", 0) if isinstance(tp_block, dict) else 0
        # the batch triple counts the data-parallel ranks: world / tp (with an mpu, dp is its data-parallel size)
        if isinstance(tp, int) and tp > 1 and not context.get("dp_from_mpu"):
            if dp % tp:
                issues.append(((("tensor_parallel", "autotp_size")), f"autotp_size={tp} does not divide the world "
                               f"size {dp}; launch a multiple of {tp} ranks or choose a size that divides {dp}"))
            else:
                issues.extend(((), p) for p in tp_batch_problems(tuple(raw), dp, tp))
                dp //= tp
        given_dp = data.get("data_parallel_size")
        if isinstance(given_dp, int) and not isinstance(given_dp, bool) and given_dp != dp and given_dp >= 1:
            issues.append(((("data_parallel_size",)), f"data_parallel_size={given_dp} but this launch has {dp} "
                           "data-parallel ranks (world / (tensor x pipeline parallel)); set it to "
                           f"{dp} or remove it (it is only checked)"))
        try:
            batch = resolve_batch(*raw, dp)
        except ConfigError as exc:
            issues.extend(((), p) for p in exc.problems)
            if isinstance(sink, list):  # placeholders, so the other sections still get checked
                data.update(dict.fromkeys((TB, MB, GA), 1))
        else:
            data.update(zip((TB, MB, GA), batch))

        sched = data.get("scheduler")
        if isinstance(sched, dict) and isinstance(sched.get("params"), dict) \
                and is_auto(sched["params"].get("warmup_max_lr")):
            lr = _optimizer_lr(data, context.get("client_optimizer"))
            if lr is not None:
                data["scheduler"] = {**sched, "params": {**sched["params"], "warmup_max_lr": lr}}
        if issues:
            if not isinstance(sink, list):
                raise ConfigIssue(issues)
            sink.extend(issues)
        return data

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and v not in _LOG_LEVELS:
            raise ValueError(f"unknown log level {v!r}; use one of {', '.join(_LOG_LEVELS)}")
        return v

    @model_validator(mode="after")
    def _check(self, info: Any) -> ZeroSpeedConfig:
        context = info.context if isinstance(info.context, dict) else {}
        self._dp_world_size = context.get("dp_world_size", 1)
        stage = self.zero_optimization.stage
        issues: list[tuple[tuple, str]] = []
        if self.fp16.enabled and self.bf16.enabled:
            issues.append(((), "fp16.enabled and bf16.enabled are both true: bfloat16 and fp16 modes cannot be "
                               "enabled together; keep one"))
        for section, flag in (("fp16", "fp16_master_weights_and_grads"), ("bf16", "bf16_master_weights_and_grads"),
                              ("bf16", "bf16_optimizer_states")):
            if getattr(getattr(self, section), flag) and stage == 0:
                issues.append(((section, flag), "needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)"))
        if self.bf16.bf16_optimizer_states and not self.bf16.bf16_master_weights_and_grads:
            issues.append((("bf16", "bf16_optimizer_states"), "needs bf16.bf16_master_weights_and_grads: true"))
        if self.gradient_allreduce_op == "sum" and stage == 3:
            issues.append((("gradient_allreduce_op",), "'sum' is not supported with ZeRO stage 3 (as in DeepSpeed); "
                                                       "use 'mean'"))
        if issues:
            raise ConfigIssue(issues)
        if self.vocabulary_size is not None and self.vocabulary_size % 8:
            warnings.warn(f"vocabulary_size {self.vocabulary_size} is not a multiple of 8; padding it may speed "
                          "up the embedding and output matmuls", UserWarning, stacklevel=2)
        return self

    @property
    def dp_world_size(self) -> int:
        """The data-parallel world size the batch triple was resolved with."""
        return self._dp_world_size

    @property
    def zero_stage(self) -> int:
        """Shortcut for ``zero_optimization.stage``."""
        return self.zero_optimization.stage

    @property
    def effective_steps_per_print(self) -> int:
        """``steps_per_print``, or 10 when unset."""
        return self.steps_per_print if self.steps_per_print is not None else DEFAULT_STEPS_PER_PRINT

    @property
    def precision(self) -> Literal["fp16", "bf16", "fp32"]:
        """The training precision the fp16/bf16 sections select."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def effective_wall_clock_breakdown(self) -> bool:
        """wall_clock_breakdown, also on when the flops profiler is enabled (DeepSpeed's rule)."""
        return self.wall_clock_breakdown or self.flops_profiler.enabled
