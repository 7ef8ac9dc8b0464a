"""Learning-rate schedules with DeepSpeed's names, arguments, formulas and stepping semantics.

These reproduce ``deepspeed.runtime.lr_schedules`` (0.19.8) value for value, so a ``"scheduler"``
block moved from a DeepSpeed config gives the same lr (and, for ``OneCycle``, momentum) sequence.

Units and stepping
------------------
* Every schedule counts **optimizer steps** in ``last_batch_iteration`` (an int, starting at -1:
  "no step taken yet"). ``step()`` advances it by one, or sets it to ``step(n)``'s argument, and
  writes ``get_lr()`` into ``optimizer.param_groups[i]["lr"]`` (lrs are plain learning-rate values,
  the same units as the optimizer's ``lr``). The engine calls ``scheduler.step()`` once after every
  optimizer step that was applied (at the gradient-accumulation boundary; not after a step skipped
  for an fp16 overflow), exactly as ``DeepSpeedEngine._take_model_step`` does.
* A schedule built with ``last_batch_iteration=-1`` writes the lr of "iteration -1" into the
  optimizer at construction, so the *first* optimizer step runs with that lr and the first
  ``step()`` moves to iteration 0. The lr of iteration -1 is: ``warmup_min_lr`` (WarmupLR,
  WarmupDecayLR), ``0.0`` (WarmupCosineLR), ``lr_range_test_min_lr`` (LRRangeTest), ``cycle_min_lr``
  (OneCycle, which also writes ``betas = (cycle_min_mom, 0.99)``). With the log and linear warm-ups
  the lr of iteration 0 is also the minimum, so the first two optimizer steps share it.
* A schedule built with another ``last_batch_iteration`` (a resume) leaves the optimizer untouched
  until the next ``step()``.
* ``state_dict()`` is ``{"last_batch_iteration": n}`` (DeepSpeed's checkpoint format);
  ``load_state_dict`` restores only that counter and, like DeepSpeed, does not rewrite the
  optimizer lr: the next ``step()`` does.
* Per-parameter-group values: ``warmup_min_lr``, ``warmup_max_lr``, ``lr_range_test_min_lr``,
  ``cycle_min_lr``/``cycle_max_lr`` and ``cycle_min_mom``/``cycle_max_mom`` accept a scalar (used for
  every group) or a list with one value per group. ``WarmupLR`` without ``warmup_max_lr`` and
  ``WarmupCosineLR`` scale each group's own ``lr``.

Deliberate difference from DeepSpeed: an unknown ``warmup_type`` raises ``ValueError`` (DeepSpeed
logs a warning and silently uses ``'log'``).
"""
from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from zerospeed.optim.cyclic_schedulers import LRRangeTest, OneCycle
from zerospeed.optim.schedule_base import _LOG, _Schedule, _check_positive_int, _per_group, _resolve_optimizer, _write_lrs
from zerospeed.utils.kwargs import check_kwargs, required_params

__all__ = [
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
    "SCHEDULERS",
    "build_scheduler",
]

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"
_WARMUP_TYPES = (WARMUP_LOG, WARMUP_LINEAR)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in _WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {list(_WARMUP_TYPES)}, got {warmup_type!r}")
    return warmup_type


def _warmup_fraction(step: int, num_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done at iteration ``0 <= step < num_steps``.

    ``'log'``: ``ln(step + 1) / ln(num_steps)``; ``'linear'``: ``step / num_steps``. Both are 0 at
    step 0; the log ramp reaches 1 at ``num_steps - 1``, the linear one ``(num_steps - 1)/num_steps``.
    """
    if warmup_type == WARMUP_LOG:
        return (1.0 / math.log(num_steps)) * math.log(step + 1)
    return step / num_steps


# ----------------------------------------------------------------------------------------------
# warm-up family
# ----------------------------------------------------------------------------------------------
class WarmupLR(_Schedule):
    """Warm the lr of each param group from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    With ``W = max(2, warmup_num_steps)`` (steps) and ``t = last_batch_iteration``::

        lr(t) = min_lr + (max_lr - min_lr) * gamma(t)
        gamma(t) = 0                         t < 0   (before the first step())
                 = ln(t + 1) / ln(W)         0 <= t < W, warmup_type='log'   (the default)
                 = t / W                     0 <= t < W, warmup_type='linear'
                 = 1                         t >= W

    ``warmup_min_lr``/``warmup_max_lr`` are lrs (scalar or one per group); ``warmup_max_lr=None``
    uses each group's current ``lr``. ``warmup_num_steps`` must be a positive int; 1 is raised to 2.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ):
        _check_positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = _resolve_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def _get_gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list:
        """The lrs of iteration ``last_batch_iteration`` (``warmup_min_lr`` before the first step)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``'s warm-up, then a linear decay to 0 at ``total_num_steps``.

    With ``W = max(2, warmup_num_steps)``, ``T = total_num_steps`` (steps), ``t = last_batch_iteration``::

        lr(t) = min_lr + (max_lr - min_lr) * gamma(t)
        gamma(t) = WarmupLR's gamma                        t < W
                 = max(0, (T - t) / max(1, T - W))         t >= W

    so the lr is ``max_lr`` at ``t = W`` and ``min_lr`` from ``t = T`` on. Note DeepSpeed's default
    ``warmup_max_lr`` here is ``0.001``, not the optimizer's lr.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )
        if self.total_num_steps < self.warmup_num_steps:
            _LOG.warning(
                "total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps
            )

    def _get_gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        decay_steps = float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - t) / decay_steps)


class WarmupCosineLR(_Schedule):
    """Scale each group's own lr by a ratio that warms up, then follows a half cosine.

    With ``W = max(2, warmup_num_steps)``, ``T = total_num_steps`` (steps), ``t = last_batch_iteration``,
    ``lr_g`` the group's lr when the schedule was built::

        lr(t) = lr_g * ratio(t)
        ratio(t) = 0                                              t < 0 (before the first step())
                 = wmin + (1 - wmin) * f(t)                       0 <= t < W, f = WarmupLR's gamma
                 = max(0, cmin + (1 - cmin) * (1 + cos(pi p)) / 2)  t >= W,
                   p = min(1, (t - W + 1) / max(1, T - W))

    ``wmin = warmup_min_ratio``, ``cmin = cos_min_ratio`` (dimensionless). The lr written at
    construction is therefore 0, and the first ``step()`` gives ``lr_g * wmin``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ):
        _check_positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = _resolve_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _check_warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            _LOG.warning(
                "total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps
            )
        self.org_lrs = [
            group["lr"].clone() if torch.is_tensor(group["lr"]) else group["lr"]
            for group in self.optimizer.param_groups
        ]
        self._last_lr = None
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        """``ratio(last_batch_iteration)`` from the class docstring."""
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            f = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + f * (1.0 - self.warmup_min_ratio)
        decay_step = t - self.warmup_num_steps + 1
        decay_total = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, decay_step / decay_total)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------
SCHEDULERS: dict[str, type] = {
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def _torch_scheduler_class(name: str) -> type | None:
    from torch.optim import lr_scheduler

    base = lr_scheduler.LRScheduler
    cls = getattr(lr_scheduler, name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)) or cls in (base, lr_scheduler._LRScheduler):
        return None
    # only schedules built as cls(optimizer, **params) (not ChainedScheduler(schedulers, ...))
    first = next(iter(list(inspect.signature(cls.__init__).parameters)[1:]), None)
    return cls if first == "optimizer" else None


def _torch_scheduler_names() -> list[str]:
    from torch.optim import lr_scheduler

    return sorted(n for n in dir(lr_scheduler) if not n.startswith("_") and _torch_scheduler_class(n))


def build_scheduler(optimizer: Any, type_name: str, params: Mapping[str, Any] | None = None) -> Any:
    """Build the schedule a config's ``"scheduler": {"type": type_name, "params": params}`` names.

    ``type_name`` is one of ``SCHEDULERS`` or, as in DeepSpeed, the name of a
    ``torch.optim.lr_scheduler`` class (e.g. ``"StepLR"``), built as ``cls(optimizer, **params)``.
    Raises ``ValueError`` for an unknown type (listing the valid names), an unknown parameter
    (naming the closest valid one) or a missing required parameter.
    """
    params = dict(params or {})
    cls = SCHEDULERS.get(type_name) or _torch_scheduler_class(type_name)
    if cls is None:
        known = list(SCHEDULERS)
        close = difflib.get_close_matches(type_name, known + _torch_scheduler_names(), n=1, cutoff=0.5)
        if not close:
            close = [k for k in known + _torch_scheduler_names() if k.lower() == str(type_name).lower()]
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown scheduler type {type_name!r}.{hint} Valid types: {', '.join(known)}, or any "
            f"torch.optim.lr_scheduler class ({', '.join(_torch_scheduler_names())})"
        )

    skip = ("self", "optimizer")
    signature = check_kwargs(cls.__init__, params, skip=skip, owner=f"scheduler {type_name}")
    missing = [name for name in required_params(signature, skip=skip) if name not in params]
    if missing:
        raise ValueError(f"scheduler {type_name} needs parameter(s) {', '.join(missing)} in its params")
    return cls(optimizer, **params)
