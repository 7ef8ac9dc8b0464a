"""The stepping core every DeepSpeed-style lr schedule shares (`_Schedule`) and its helpers.

`schedulers.py` (the warm-up family, the registry, `build_scheduler`) and `cyclic_schedulers.py`
(LRRangeTest, OneCycle) both build on this module, so neither imports the other's internals (they
used to import each other: an import cycle). Units and stepping semantics: see
``zerospeed.optim.schedulers``'s docstring.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

# the schedules' warnings keep the logger name they always had
_LOG = logging.getLogger("zerospeed.optim.schedulers")


def _resolve_optimizer(optimizer: Any) -> Any:
    """The object whose ``param_groups`` the schedule writes.

    A ``torch.optim.Optimizer`` is used as is; a wrapper exposing a torch optimizer as
    ``.optimizer`` (DeepSpeed's rule, e.g. a ZeRO or mixed-precision wrapper) is unwrapped; any
    other object with ``param_groups`` is accepted as is.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    if hasattr(optimizer, "param_groups"):
        return optimizer
    raise TypeError(
        f"{type(optimizer).__name__} is not a torch.optim.Optimizer, does not wrap one as "
        "`.optimizer`, and has no `param_groups`; pass the optimizer the schedule should drive"
    )


def _per_group(optimizer: Any, value: Any, name: str) -> list:
    """Broadcast a scalar to every param group, or check a list/tuple has one value per group."""
    n_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {n_groups} param groups; "
                f"give one value per group or a single scalar"
            )
        return list(value)
    return [value] * n_groups


def _write_lrs(param_groups: Sequence[dict], lrs: Sequence[Any]) -> list:
    """Write ``lrs`` into the groups (in place for tensor lrs) and return the groups' lrs."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _check_positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer (a number of steps), got {value!r}")


class _Schedule:
    """Shared DeepSpeed stepping: a ``last_batch_iteration`` counter written through to the lrs."""

    optimizer: Any
    last_batch_iteration: int
    _last_lr: list | None = None

    def get_lr(self) -> list:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_last_lr(self) -> list:
        """The lrs most recently written into the optimizer (one per param group)."""
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__} has not written an lr yet (it was built with "
                f"last_batch_iteration={self.last_batch_iteration}); call step() first"
            )
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the current one + 1) and write its lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore the step counter only; the optimizer lr is rewritten by the next ``step()``."""
        self.last_batch_iteration = sd["last_batch_iteration"]
