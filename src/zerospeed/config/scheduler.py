"""The ``scheduler`` block: DeepSpeed's LR schedules (``ds/runtime/lr_schedules.py``).

Parameter names and defaults are DeepSpeed's. Traps worth knowing:

* ``warmup_type`` defaults to **"log"** (the LR rises like log(step)), not "linear".
* WarmupLR's ``warmup_max_lr`` default None means "the optimizer's lr"; WarmupDecayLR's is 0.001.
* WarmupDecayLR and WarmupCosineLR require ``total_num_steps`` (optimizer steps, not micro-steps).
* The scheduler is stepped once per optimizer step (at the gradient-accumulation boundary).

As in DeepSpeed, any other ``type`` naming a ``torch.optim.lr_scheduler`` class (e.g. "StepLR")
is built as ``cls(optimizer, **params)``; its params are checked against the class signature.

``"auto"`` in params means "the default", except ``warmup_max_lr: "auto"``, which takes the
optimizer's lr (filled in by the top-level config), and ``warmup_num_steps`` and the required
``total_num_steps``, which cannot be "auto": the Hugging Face Trainer fills them from its step
count and warm-up arguments (``max(1, warmup_steps)``, so 1 with its defaults, not DeepSpeed's
default 1000); zerospeed has no Trainer, so the error asks for a number.
"""
from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationError

from ._base import ConfigModel, is_auto, issues_from_validation_error
from .errors import ConfigIssue, closest_key, short_repr

__all__ = [
    "SchedulerConfig",
    "DEEPSPEED_SCHEDULERS",
    "WarmupLRParams",
    "WarmupDecayLRParams",
    "WarmupCosineLRParams",
    "OneCycleParams",
    "LRRangeTestParams",
]

LR = Union[float, list[float]]  # one value, or one per param group
WarmupType = Literal["log", "linear"]


class _Params(ConfigModel):
    last_batch_iteration: int = -1
    """Index of the last batch when resuming (-1 = start from the beginning)."""


class WarmupLRParams(_Params):
    """WarmupLR: rise from warmup_min_lr to warmup_max_lr over warmup_num_steps, then stay."""

    warmup_min_lr: LR = 0.0
    warmup_max_lr: Optional[LR] = None
    """None (default) = the optimizer's lr (param group 0)."""
    warmup_num_steps: int = Field(1000, gt=0)
    warmup_type: WarmupType = "log"
    """"log" (default) or "linear"."""


class WarmupDecayLRParams(_Params):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: int = Field(gt=0)
    warmup_min_lr: LR = 0.0
    warmup_max_lr: LR = 0.001
    warmup_num_steps: int = Field(1000, gt=0)
    warmup_type: WarmupType = "log"


class WarmupCosineLRParams(_Params):
    """WarmupCosineLR: ratio of the optimizer's lr, warm-up then cosine decay to cos_min_ratio."""

    total_num_steps: int = Field(gt=0)
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = Field(1000, gt=0)
    cos_min_ratio: float = 0.0001
    warmup_type: WarmupType = "log"


class OneCycleParams(_Params):
    """OneCycle: one cycle of lr (and momentum) between bounds, then optional decay."""

    cycle_min_lr: LR
    cycle_max_lr: LR
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = Field(2000, gt=0)
    cycle_second_step_size: Optional[int] = None
    """None = cycle_first_step_size."""
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: Optional[int] = None
    """None = cycle_first_stair_count."""
    decay_step_size: int = 0
    cycle_momentum: bool = True
    cycle_min_mom: LR = 0.8
    cycle_max_mom: LR = 0.9
    decay_mom_rate: float = 0.0


class LRRangeTestParams(_Params):
    """LRRangeTest: grow the lr from lr_range_test_min_lr to find the largest usable lr."""

    lr_range_test_min_lr: LR = 0.001
    lr_range_test_step_size: int = Field(2000, gt=0)
    lr_range_test_step_rate: float = 1.0
    lr_range_test_staircase: bool = False


#: DeepSpeed schedule name -> its params model.
DEEPSPEED_SCHEDULERS: dict[str, type[_Params]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}


@functools.lru_cache(maxsize=None)
def _torch_scheduler_signature(name: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(accepted kwargs, required kwargs) of ``torch.optim.lr_scheduler.<name>``, or None."""
    from torch.optim import lr_scheduler

    cls = getattr(lr_scheduler, name, None)
    if not (isinstance(cls, type) and issubclass(cls, lr_scheduler.LRScheduler)) or name.startswith("_") \
            or cls is lr_scheduler.LRScheduler:
        return None
    params = [p for n, p in inspect.signature(cls.__init__).parameters.items() if n not in ("self", "optimizer")
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return tuple(p.name for p in params), tuple(p.name for p in params if p.default is p.empty)


def _torch_scheduler_names() -> list[str]:
    from torch.optim import lr_scheduler

    return sorted(n for n in dir(lr_scheduler) if _torch_scheduler_signature(n) is not None)


class SchedulerConfig(ConfigModel):
    """``scheduler``: the LR schedule built around the optimizer.

    Read ``type`` and ``kwargs()`` (every parameter, defaults filled for DeepSpeed schedules).
    """

    type: str
    """One of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest (exact spelling, as in
    DeepSpeed), or a torch.optim.lr_scheduler class name."""
    params: dict[str, Any] = Field(default_factory=dict)
    """For DeepSpeed schedules: all parameters with DeepSpeed's defaults filled in."""

    @classmethod
    def _prepare(cls, data: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        name = data.get("type")
        params = data.get("params")
        if params is None or is_auto(params):
            params = {}
        if not isinstance(name, str) or is_auto(name):
            raise ConfigIssue.at("type", f"required: one of {', '.join(DEEPSPEED_SCHEDULERS)}, or a "
                                         f"torch.optim.lr_scheduler class name; got {short_repr(name)}")
        if not isinstance(params, dict):
            raise ConfigIssue.at("params", f"must be a JSON object of schedule parameters, got {short_repr(params)}")
        if name in DEEPSPEED_SCHEDULERS:
            data["params"] = _check_deepspeed_params(name, dict(params))
        elif _torch_scheduler_signature(name) is not None:
            data["params"] = _check_torch_params(name, dict(params))
        else:
            best = closest_key(name, list(DEEPSPEED_SCHEDULERS) + _torch_scheduler_names())
            hint = f"did you mean '{best}'? " if best else ""
            raise ConfigIssue.at("type", f"unknown scheduler '{name}': {hint}DeepSpeed schedules: "
                                         f"{', '.join(DEEPSPEED_SCHEDULERS)} (or a torch.optim.lr_scheduler class)")
        return data

    def kwargs(self) -> dict[str, Any]:
        """A fresh plain dict of the schedule's constructor arguments (besides the optimizer)."""
        return copy.deepcopy(dict(self.params))


def _check_deepspeed_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    model = DEEPSPEED_SCHEDULERS[name]
    required = [k for k, f in model.model_fields.items() if f.is_required()]
    issues = []
    for key in required:
        if key not in params:
            issues.append((("params", key), f"{name} requires '{key}' (e.g. the total number of optimizer steps)"
                           if key == "total_num_steps" else f"{name} requires '{key}'"))
        elif is_auto(params[key]):
            issues.append((("params", key), "is 'auto' but zerospeed cannot derive it: set it explicitly"))
    if "warmup_num_steps" in model.model_fields and is_auto(params.get("warmup_num_steps")):
        issues.append((("params", "warmup_num_steps"),
                       "is 'auto', which the Hugging Face Trainer fills from its warm-up arguments "
                       "(max(1, warmup_steps): 1 with its defaults); zerospeed cannot derive it: set the number "
                       "of warm-up optimizer steps (DeepSpeed's default, when the key is absent, is 1000)"))
    if issues:
        raise ConfigIssue(issues)
    try:
        validated = model.model_validate(params)
    except ValidationError as exc:
        raise ConfigIssue((("params",) + p, m) for p, m in issues_from_validation_error(exc, model)) from None
    return validated.model_dump()


def _check_torch_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    accepted, required = _torch_scheduler_signature(name)
    issues = []
    for key, value in params.items():
        if key not in accepted:
            best = closest_key(key, accepted)
            hint = f"did you mean '{best}'? " if best else ""
            issues.append((("params", key), f"unknown parameter for torch.optim.lr_scheduler.{name}: {hint}"
                                            f"valid: {', '.join(accepted)}"))
        elif is_auto(value):
            issues.append((("params", key), "'auto' is not supported for torch schedulers: set a value"))
    issues += [(("params", k), f"{name} requires '{k}'") for k in required if k not in params]
    if issues:
        raise ConfigIssue(issues)
    return params
