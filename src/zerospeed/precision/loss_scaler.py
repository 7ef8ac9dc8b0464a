"""fp16 loss scaling with DeepSpeed's fields and semantics (`deepspeed/runtime/fp16/loss_scaler.py`).

The engine multiplies the loss by `loss_scale` before backward, the strategy divides the gradients
by it before the norm / clipping, and after every optimizer-step attempt the engine calls
`update_scale(overflow)` with the overflow decision all ranks agreed on.

`DynamicLossScaler.update_scale` is DeepSpeed's `DynamicLossScaler.update_scale` (the one ZeRO
stages 1-3 use), field by field:

* overflow, hysteresis left (`cur_hysteresis > 1` and `hysteresis > 1`): the step is skipped, the
  scale is kept and `cur_hysteresis` drops by one;
* overflow, hysteresis used up: the scale halves (never below `min_scale`); if it already *is*
  `min_scale` the run cannot continue and `LossScaleAtMinimumError` is raised;
* no overflow: with `consecutive_hysteresis` the hysteresis is refilled at once; after every
  `scale_window` consecutive clean iterations since the last overflow the scale doubles (and the
  hysteresis is refilled);
* `cur_iter` counts every call (skipped or not), `last_overflow_iter` the last overflow.

Differences from DeepSpeed, on purpose: the error at the minimum names the first parameters with
non-finite gradients and says what to change (DeepSpeed: "Current loss scale already at minimum -
cannot decrease scale anymore. Exiting run.", pain point #8); and logging is the engine's, rate-
limited (DeepSpeed logs every overflow). DeepSpeed's stage-0 `FP16_Optimizer` clamps at the minimum
silently instead of raising; we raise at every stage, because an overflow at the minimum scale is
not a scaling problem and silent skipping trains nothing.
"""
from __future__ import annotations

from typing import Callable

import torch


class LossScaleAtMinimumError(RuntimeError):
    """The gradients overflow although the fp16 loss scale is already at `min_loss_scale`."""


class LossScaler:
    """A fixed loss scale (1.0 = no scaling: bf16 and fp32). Base of `DynamicLossScaler`."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        if not scale > 0 or scale == float("inf"):
            raise ValueError(f"the loss scale must be finite and > 0, got {scale}")
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * loss_scale` (the loss itself when the scale is 1)."""
        return loss if self.cur_scale == 1.0 else loss * self.cur_scale

    def update_scale(self, overflow: bool, *, nonfinite_names: Callable[[], list[str]] | None = None) -> None:
        """A static scale never changes."""

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        self.cur_scale = float(state["cur_scale"])


class StaticLossScaler(LossScaler):
    """`fp16.loss_scale > 0`: always scale by that value (DeepSpeed's `LossScaler`). Overflowing
    steps are still skipped by the engine, but the scale stays."""


class DynamicLossScaler(LossScaler):
    """`fp16.loss_scale == 0`. Arguments in DeepSpeed's names: init_scale (2**initial_scale_power),
    scale_window (loss_scale_window), min_scale (min_loss_scale), hysteresis (DeepSpeed's
    delayed_shift), consecutive_hysteresis. State: cur_scale, cur_iter, last_overflow_iter,
    cur_hysteresis. Raises ValueError for a non-positive init_scale / min_scale / scale_window /
    hysteresis."""

    dynamic = True
    scale_factor = 2.0

    def __init__(self, *, init_scale: float = 2.0**16, scale_window: int = 1000, min_scale: float = 1.0,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False, raise_error_at_min_scale: bool = True):
        super().__init__(init_scale)
        for name, value in (("scale_window", scale_window), ("min_scale", min_scale), ("hysteresis", hysteresis)):
            if not value > 0:
                raise ValueError(f"DynamicLossScaler: {name} must be > 0, got {value}")
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(hysteresis)
        self.cur_hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, fp16) -> DynamicLossScaler:
        """From the validated `fp16` config section (loss_scale == 0)."""
        return cls(init_scale=fp16.initial_dynamic_scale, scale_window=fp16.loss_scale_window,
                   min_scale=fp16.min_loss_scale, hysteresis=fp16.hysteresis,
                   consecutive_hysteresis=fp16.consecutive_hysteresis)

    @property
    def hysteresis(self) -> int:
        return self.delayed_shift

    def update_scale(self, overflow: bool, *, nonfinite_names: Callable[[], list[str]] | None = None) -> None:
        """Advance one iteration (see the module docstring). nonfinite_names: called (possibly a
        collective: call `update_scale` on every rank) only when raising, for the message.
        Raises LossScaleAtMinimumError when an overflow finds the scale at its minimum."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(self._at_minimum_message(nonfinite_names))
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def _at_minimum_message(self, nonfinite_names) -> str:
        names = nonfinite_names() if nonfinite_names is not None else []
        where = (f" First parameters with non-finite (inf/nan) gradients: {', '.join(names)}."
                 if names else " (no parameter gradient is non-finite after the reduction: check the loss)")
        return (f"fp16 dynamic loss scaling collapsed: the gradients overflow (inf/nan) although the loss scale "
                f"is already at its minimum min_loss_scale={self.min_scale:g} (iteration {self.cur_iter}, "
                f"hysteresis {self.delayed_shift}).{where} At this scale the overflow is not a scaling problem: "
                "the forward or backward itself produces inf/nan in fp16. Train in bf16 instead "
                '("bf16": {"enabled": true}; same range as fp32, no loss scaling) if the hardware supports it, '
                "or lower the learning rate, enable gradient_clipping, or check the data and the loss for "
                "inf/nan.")

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale, "dynamic": True, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "cur_hysteresis": self.cur_hysteresis,
                "scale_window": self.scale_window, "min_scale": self.min_scale, "hysteresis": self.delayed_shift,
                "consecutive_hysteresis": self.consecutive_hysteresis}

    def load_state_dict(self, state: dict) -> None:
        """Restore the running state (scale, iteration counters, hysteresis left); the settings
        (window, minimum, hysteresis) stay those of this run's config."""
        self.cur_scale = float(state["cur_scale"])
        if state.get("dynamic", False):
            self.cur_iter = int(state["cur_iter"])
            self.last_overflow_iter = int(state["last_overflow_iter"])
            self.cur_hysteresis = int(state["cur_hysteresis"])


def build_loss_scaler(fp16) -> LossScaler:
    """The scaler for the validated `fp16` section: dynamic (loss_scale 0), static (> 0), or the
    no-op scale 1.0 when fp16 is disabled (bf16, fp32)."""
    if not fp16.enabled:
        return LossScaler(1.0)
    if fp16.dynamic_loss_scale:
        return DynamicLossScaler.from_config(fp16)
    return StaticLossScaler(fp16.loss_scale)
