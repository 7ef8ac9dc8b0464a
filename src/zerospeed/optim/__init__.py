"""Optimizers and learning-rate schedules.

* ``build_optimizer(params, class_name, kwargs)``: a ``torch.optim`` optimizer on torch's
  fused/foreach implementation, or one of zerospeed's own (``OWN_OPTIMIZERS``).
* ``Lamb`` (You et al. 2020, Algorithm 2) and ``Lion`` (Chen et al. 2023, Algorithm 1), with
  DeepSpeed's FusedLamb / FusedLion arguments.
* ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``: DeepSpeed's
  schedules, same arguments and lr sequences; ``build_scheduler(optimizer, type_name, params)``
  builds one from a config's ``"scheduler"`` block.
"""
from zerospeed.optim.factory import OWN_OPTIMIZERS, TORCH_OPTIMIZERS, build_optimizer, resolve_optimizer_class
from zerospeed.optim.lamb import Lamb
from zerospeed.optim.lion import Lion
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
    "resolve_optimizer_class",
    "OWN_OPTIMIZERS",
    "TORCH_OPTIMIZERS",
    "Lamb",
    "Lion",
    "build_scheduler",
    "SCHEDULERS",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
]
