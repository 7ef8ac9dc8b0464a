"""Mixed-precision sections: ``fp16``, ``bf16`` (alias ``bfloat16``), ``torch_autocast``, ``data_types``.

Mirrors ``deepspeed/runtime/precision_config.py`` (DeepSpeed 0.19.8). fp16 and bf16 both enabled
is rejected by the top-level model.
"""
from __future__ import annotations

import math
from typing import Any, Literal, Optional

from pydantic import field_validator, model_validator

from ._base import ConfigModel
from .errors import ConfigIssue

__all__ = ["FP16Config", "BF16Config", "TorchAutocastConfig", "DataTypesConfig", "canonical_dtype"]

DtypeName = Literal["fp16", "bf16", "fp32"]

_DTYPE_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}


def canonical_dtype(value: Any) -> Any:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ... -> ``"bf16"`` (DeepSpeed's DtypeEnum spellings)."""
    if isinstance(value, str) and value.strip().lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[value.strip().lower()]
    if value is not None and not isinstance(value, str):  # a torch.dtype
        text = str(value).lower()
        if text in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[text]
    return value


def torch_dtype(name: str | None):
    """``"bf16"`` -> ``torch.bfloat16`` (None stays None). Imports torch lazily."""
    if name is None:
        return None
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


class FP16Config(ConfigModel):
    """``fp16``: fp16 mixed precision with loss scaling.

    ``loss_scale`` 0 (default) means *dynamic* loss scaling starting at ``2**initial_scale_power``;
    a positive value is a static scale. Dynamic scaling halves the scale after ``hysteresis``
    overflowing steps (which are skipped) and doubles it after ``loss_scale_window`` clean steps,
    never going below ``min_loss_scale``.
    """

    enabled: bool = False
    """Train with fp16 parameters and gradients (fp32 master weights). Default false. ``"auto"`` = true
    when every floating-point parameter of the model given to ``load_config(model=)`` is fp16 and
    bf16 is not enabled, else false (the Hugging Face Trainer's default ``fp16=False``)."""
    auto_cast: bool = False
    """Cast floating-point inputs of the model's forward to fp16. Default false."""
    loss_scale: float = 0.0
    """0 = dynamic loss scaling (default); > 0 = static scale. Must be finite and >= 0."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power (default 16 -> 65536)."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale is doubled (default 1000)."""
    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic scale is halved (default 2)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis counter after each step without overflow (default false)."""
    min_loss_scale: int = 1
    """Floor of the dynamic loss scale (default 1)."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and grads in fp16 (ZeRO stage >= 1 only). Default false."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _check_loss_scale(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("must be a number, not a boolean")
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError("must be a number (0 = dynamic loss scaling)") from None
        if not math.isfinite(f):
            raise ValueError("must be finite (not inf/nan); 0 enables dynamic loss scaling")
        if f < 0:
            raise ValueError("must be >= 0 (0 enables dynamic loss scaling)")
        return f

    @model_validator(mode="after")
    def _check_dynamic(self) -> FP16Config:
        if self.dynamic_loss_scale:
            issues = [((k,), f"must be > 0 with dynamic loss scaling (loss_scale=0), got {getattr(self, k)}")
                      for k in ("loss_scale_window", "min_loss_scale") if getattr(self, k) <= 0]
            if issues:
                raise ConfigIssue(issues)
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when ``loss_scale`` is 0 (dynamic scaling)."""
        return self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        """``2 ** initial_scale_power``: the first dynamic loss scale."""
        return float(2**self.initial_scale_power)


class BF16Config(ConfigModel):
    """``bf16`` (the old key ``bfloat16`` is accepted with a deprecation warning)."""

    enabled: bool = False
    """Train with bf16 parameters and gradients (fp32 master weights). Default false. ``"auto"`` = true
    when every floating-point parameter of the model given to ``load_config(model=)`` is bf16 and
    fp16 is not enabled, else false (the Hugging Face Trainer's default ``bf16=False``)."""
    immediate_grad_update: bool = False
    """Apply each gradient to the fp32 accumulator as soon as it is produced (default false;
    DeepSpeed's constants.py says true but its pydantic model, which wins, says false)."""
    check_grad_overflow: bool = True
    """Check gradients for inf/nan and SKIP the optimizer step when found, as fp16 does
    (default true in DeepSpeed 0.19). A skipped step does not advance the LR scheduler."""
    bf16_master_weights_and_grads: bool = False
    """Keep master weights and grads in bf16 instead of fp32 (ZeRO stage >= 1 only)."""
    bf16_optimizer_states: bool = False
    """Keep optimizer states in bf16 (needs bf16_master_weights_and_grads and ZeRO >= 1)."""


class TorchAutocastConfig(ConfigModel):
    """``torch_autocast``: run the forward under ``torch.autocast`` instead of casting the model."""

    enabled: bool = False
    """Default false."""
    dtype: Optional[DtypeName] = None
    """Autocast dtype, stored as ``"fp16"``/``"bf16"``/``"fp32"`` (any DeepSpeed spelling such as
    ``"bfloat16"`` or ``"torch.float16"`` is accepted). None = the engine's choice (bf16)."""
    lower_precision_safe_modules: Optional[list[str]] = None
    """Fully qualified class names whose parameters may be kept in the low-precision dtype."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        return canonical_dtype(v)

    @property
    def torch_dtype(self):
        return torch_dtype(self.dtype)


class DataTypesConfig(ConfigModel):
    """``data_types``: dtypes of gradient accumulation, parameters and buffers.

    Each dtype is stored as ``"fp16"``/``"bf16"``/``"fp32"`` or None (= follow fp16/bf16 config).
    """

    grad_accum_dtype: Optional[DtypeName] = None
    """dtype of the gradient accumulation buffer. None = the model's dtype."""
    param_dtype: Optional[DtypeName] = None
    """dtype of the model parameters. None = from fp16/bf16 config."""
    buffer_dtype: Optional[DtypeName] = None
    """dtype of module buffers. None = keep the dtype they were loaded with."""
    keep_in_fp32_modules: Optional[list[str]] = None
    """Module names kept in fp32 (``"auto"`` = default None)."""

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        return canonical_dtype(v)
