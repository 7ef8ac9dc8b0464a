"""Optimizers and learning-rate schedules.

* ``build_optimizer(params, torch_class_name, kwargs)``: a ``torch.optim`` optimizer on torch's
  fused/foreach implementation.
* ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``: DeepSpeed's
  schedules, same arguments and lr sequences; ``build_scheduler(optimizer, type_name, params)``
  builds one from a config's ``"scheduler"`` block.
"""
from zerospeed.optim.factory import TORCH_OPTIMIZERS, build_optimizer
from zerospeed.optim.schedulers import (
    SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "build_optimizer",
    "TORCH_OPTIMIZERS",
    "build_scheduler",
    "SCHEDULERS",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
]
