"""Mixed precision: the dtype policy, fp16 loss scaling and overflow bookkeeping.

`MixedPrecisionPolicy` says which dtype parameters, gradient collectives and master weights use;
every ZeRO stage composes with it (DESIGN.md rule 8). `DynamicLossScaler` / `StaticLossScaler`
follow DeepSpeed's fields and semantics. Layering: uses only torch (and the config section objects
handed in); `zero/` and `runtime/` use this package.
"""
from .loss_scaler import (DynamicLossScaler, LossScaleAtMinimumError, LossScaler, StaticLossScaler,
                          build_loss_scaler)
from .overflow import OVERFLOW_LOG_EVERY, SkipLog, first_nonfinite, is_nonfinite
from .policy import MixedPrecisionPolicy

__all__ = ["MixedPrecisionPolicy", "LossScaler", "StaticLossScaler", "DynamicLossScaler", "LossScaleAtMinimumError",
           "build_loss_scaler", "SkipLog", "first_nonfinite", "is_nonfinite", "OVERFLOW_LOG_EVERY"]
