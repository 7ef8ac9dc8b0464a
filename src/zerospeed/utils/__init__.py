"""Shared helpers; and DeepSpeed's `deepspeed.utils` that user scripts import: the parameter accessors
(`safe_get_full_fp32_param`, ...), `RepeatingLoader`, `OnDevice`, `logger` and the ZeRO-3 leaf-module flags
(`set_z3_leaf_modules`, ...)."""
from .init_on_device import OnDevice
from .repeating_loader import RepeatingLoader
from .tensor_fragment import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                              safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                              safe_set_full_fp32_param, safe_set_full_optimizer_state)
from .z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules, unset_z3_leaf_modules,
                             z3_leaf_module)


def __getattr__(name):  # the package logger, with its handler set up on first use
    if name == "logger":
        from .logging import setup_logger

        return setup_logger()
    raise AttributeError(f"module 'zerospeed.utils' has no attribute {name!r}")


__all__ = ["OnDevice", "RepeatingLoader", "get_z3_leaf_modules", "logger", "safe_get_full_fp32_param",
           "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_optimizer_state",
           "set_z3_leaf_module", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module"]
