"""DeepSpeed's cyclic schedules: ``LRRangeTest`` (Smith 2017, "Cyclical Learning Rates", §3.3) and
``OneCycle`` (Smith & Topin 2018, "Super-Convergence"), value for value as deepspeed.runtime.lr_schedules.

Stepping semantics and units are those of ``zerospeed.optim.schedulers`` (see its docstring).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from torch.optim import Optimizer

from zerospeed.optim.schedule_base import _LOG, _Schedule, _check_positive_int, _per_group, _resolve_optimizer, _write_lrs

# DeepSpeed's OneCycle writes betas = (momentum, 0.99): the second Adam beta is replaced by 0.99
# whatever the optimizer was built with. Kept for parity; see OneCycle's docstring.
_ONECYCLE_BETA2 = 0.99

__all__ = ["LRRangeTest", "OneCycle"]

# ----------------------------------------------------------------------------------------------
# range test and one-cycle
# ----------------------------------------------------------------------------------------------
class LRRangeTest(_Schedule):
    """Grow the lr from ``lr_range_test_min_lr`` at a constant rate, to find the largest usable lr.

    With ``S = lr_range_test_step_size`` (steps), ``r = lr_range_test_step_rate`` and
    ``t = last_batch_iteration``::

        lr(t) = min_lr * (1 + r * k(t))
        k(t) = (t + 1) / S           continuous (default)
             = floor((t + 1) / S)    lr_range_test_staircase=True

    ``lr(-1) = min_lr`` is written at construction. ``min_lr`` is a scalar or one value per group.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        self.optimizer = _resolve_optimizer(optimizer)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        _check_positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        ratio = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(ratio) if self.staircase else ratio

    def get_lr(self) -> list:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:  # DeepSpeed's argument name
        super().step(batch_iteration)


class OneCycle(_Schedule):
    """1Cycle: lr up then down between two bounds (momentum the other way), then an optional decay.

    Steps (all in optimizer steps): ``S1 = cycle_first_step_size``, ``S2 = cycle_second_step_size``
    (default ``S1``), ``N = S1 + S2``; ``b = last_batch_iteration + 1``. Inside the cycle (``b <= N``,
    i.e. ``last_batch_iteration < N``) the position ``c = b mod N`` gives a scale ``s`` in [0, 1]::

        s = c / S1                 c <= S1   (rising half)
          = (N - c) / S2           c > S1    (falling half)
        with stairs (cycle_first_stair_count K1 / cycle_second_stair_count K2, 0 = off):
        s = floor(c * K1 / S1) / K1  or  floor((N - c) * K2 / S2) / K2

        lr  = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * s
        mom = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * s      (betas[0])

    After the cycle (``last_batch_iteration >= N``), with ``d = last_batch_iteration - N + 1`` and
    ``D = decay_step_size``::

        lr  = cycle_min_lr / (1 + decay_lr_rate * d / D)
        mom = cycle_max_mom * (1 + decay_mom_rate * d / D)

    and with ``D == 0`` or a zero rate the lr stays at ``cycle_min_lr`` (momentum at
    ``cycle_max_mom``). At construction (``last_batch_iteration=-1``) lr = ``cycle_min_lr`` and
    betas = ``(cycle_min_mom, 0.99)`` are written.

    Momentum is cycled only when ``cycle_momentum`` and the optimizer has ``betas`` in its
    defaults (Adam-like); for others (e.g. SGD) it is switched off with a warning. DeepSpeed
    writes ``betas = (mom, 0.99)``, replacing the optimizer's second beta with 0.99; we keep that
    for identical training.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ):
        self.optimizer = _resolve_optimizer(optimizer)
        self._last_lr = None

        # cycle shape
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive (steps), got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(
                f"cycle_second_step_size must be non-negative (steps), got {cycle_second_step_size}"
            )
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay = decay_step_size == 0

        # lr
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or decay_lr_rate == 0
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.min_lrs)

        # momentum
        self.cycle_momentum = cycle_momentum
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = no_decay or decay_mom_rate == 0
        if cycle_momentum:
            if "betas" not in getattr(self.optimizer, "defaults", {}):
                _LOG.warning(
                    "OneCycle: cycle_momentum is disabled because %s has no 'betas' "
                    "(DeepSpeed cycles only Adam-style betas[0], not SGD momentum)",
                    type(self.optimizer).__name__,
                )
                self.cycle_momentum = False
            else:
                self.min_moms = [
                    (m, _ONECYCLE_BETA2) for m in _per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")
                ]
                self.max_moms = [
                    (m, _ONECYCLE_BETA2) for m in _per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")
                ]
                if last_batch_iteration == -1:
                    for group, betas in zip(self.optimizer.param_groups, self.min_moms):
                        group["betas"] = betas

        self.last_batch_iteration = last_batch_iteration

    def _scale_factor(self) -> float:
        b = self.last_batch_iteration + 1
        cycle = math.floor(1 + b / self.total_size)
        x = 1.0 + b / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            # quantise from the integer position, not from `scale` (which can sit 1 ulp under a stair)
            c = b % self.total_size
            if c <= self.first_step_size:
                position = c * stairs / self.first_step_size
            else:
                position = (self.total_size - c) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list:
        """The lrs of iteration ``last_batch_iteration`` (cycle, then decay)."""
        if self.last_batch_iteration < self.total_size:
            s = self._scale_factor()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        d = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * (d / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list | None:
        """The ``betas`` tuples of iteration ``last_batch_iteration``, or None if not cycling momentum."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            s = self._scale_factor()
            return [
                (hi[0] - (hi[0] - lo[0]) * s, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        d = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * (d / self.decay_step_size)
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:  # DeepSpeed's argument name
        """Advance one step (or to ``batch_iteration``); write lrs and, if cycling, ``betas``."""
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas
