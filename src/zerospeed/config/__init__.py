"""The ds_config: read, checked and resolved once, before any process group or tensor exists.

    cfg = load_config("ds_config.json", dp_world_size=2)
    cfg.train_micro_batch_size_per_gpu            # int, resolved
    cfg.optimizer.torch_class_name                # "AdamW" for {"type": "Adam"} (DeepSpeed's rule)
    cfg.optimizer.torch_kwargs()                  # {"lr": ..., "betas": (0.9, 0.999), ...}
    cfg.scheduler.type, cfg.scheduler.kwargs()    # "WarmupLR", all params with defaults filled
    cfg.zero_optimization.stage                   # 0..3
    cfg.zero_optimization.reduce_bucket_size      # elements

Keys, aliases and defaults are DeepSpeed 0.19.8's. Unlike DeepSpeed, every section is strict: an
unknown key anywhere is an error naming its dotted path and the closest valid key, and DeepSpeed
keys that were removed or that zerospeed does not implement yet are errors, never ignored.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ._base import ConfigModel, issues_from_validation_error
from .auto import ModelHints, model_hints
from .batch import BatchSizes, resolve_batch
from .errors import ConfigDeprecationWarning, ConfigError, closest_key, format_path
from .loader import parse_source
from .optimizer import SUPPORTED_OPTIMIZERS, OptimizerConfig
from .precision import BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig
from .scheduler import DEEPSPEED_SCHEDULERS, SchedulerConfig
from .schema import DEFAULT_STEPS_PER_PRINT, ZeroSpeedConfig
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
from .zero import LeafModuleConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "load_config",
    "ModelHints",
    "model_hints",
    "ConfigError",
    "ConfigDeprecationWarning",
    "ZeroSpeedConfig",
    "resolve_batch",
    "BatchSizes",
    "parse_source",
    "closest_key",
    "ConfigModel",
    "OptimizerConfig",
    "SchedulerConfig",
    "FP16Config",
    "BF16Config",
    "TorchAutocastConfig",
    "DataTypesConfig",
    "ZeroConfig",
    "OffloadParamConfig",
    "OffloadOptimizerConfig",
    "LeafModuleConfig",
    "CommsLoggerConfig",
    "ActivationCheckpointingConfig",
    "FlopsProfilerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "CSVMonitorConfig",
    "AIOConfig",
    "CheckpointConfig",
    "SUPPORTED_OPTIMIZERS",
    "DEEPSPEED_SCHEDULERS",
    "DEFAULT_STEPS_PER_PRINT",
]


def load_config(source: Any, *, dp_world_size: int = 1, client_optimizer: Any = None,
                model: Any = None, dp_from_mpu: bool = False) -> ZeroSpeedConfig:
    """Read, validate and resolve a ds_config.

    source: a dict, a path (str or os.PathLike) to a JSON file, a JSON string, or a
        urlsafe-base64 JSON string.
    dp_world_size: number of data-parallel ranks, used to complete the batch triple
        (``train_batch_size = micro x grad_accum x dp_world_size``); without `dp_from_mpu` and with
        ``tensor_parallel.autotp_size`` > 1 it is the world, divided by autotp_size here.
    dp_from_mpu: dp_world_size is an mpu's data-parallel size (its tensor-parallel ranks already left out).
    client_optimizer: the user's optimizer (or anything with ``param_groups`` / ``defaults``);
        ``"auto"`` values of ``optimizer.params`` (lr, betas, eps, weight_decay) are copied from it.
    model: the model (an ``nn.Module``; only read, never moved or called), or a ``ModelHints``.
        The Hugging Face Trainer's model-derived ``"auto"`` values are resolved from it:
        ``reduce_bucket_size`` = hidden_size**2, at stage 3 ``stage3_prefetch_bucket_size`` =
        int(0.9 * hidden_size**2) and ``stage3_param_persistence_threshold`` = 10 * hidden_size
        (hidden size from ``model.config``), ``fp16/bf16.enabled`` from the parameters' dtype.
        Without it these "auto" values are errors naming the key (see ``config/auto.py``).

    Returns a frozen ZeroSpeedConfig. Raises ConfigError listing every problem found, each with
    the dotted path of the key, the value and what was expected. Deprecated keys are remapped with
    a ConfigDeprecationWarning.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError(f"dp_world_size must be a positive integer, got {dp_world_size!r}")
    raw = parse_source(source)
    deferred: list = []
    context = {"dp_world_size": dp_world_size, "client_optimizer": client_optimizer, "deferred_issues": deferred,
               "model_hints": model_hints(model), "dp_from_mpu": dp_from_mpu}
    try:
        config = ZeroSpeedConfig.model_validate(raw, context=context)
        issues = []
    except ValidationError as exc:
        issues = issues_from_validation_error(exc, ZeroSpeedConfig)
    issues = deferred + issues
    if not issues:
        return config
    problems = [f"{format_path(path)}: {msg}" if path else msg for path, msg in issues]
    raise ConfigError(problems)
