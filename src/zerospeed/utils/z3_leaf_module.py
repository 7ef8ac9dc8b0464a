"""ZeRO-3 leaf modules flagged in the model, as DeepSpeed's `deepspeed.utils.set_z3_leaf_modules`.

A flagged module is one ZeRO-3 gather unit: all its parameters are gathered with one all-gather before its
forward and released after its backward, however its submodules are called (MoE blocks whose experts run
or not depending on the routing; DeepSpeed's reason for the flag). The flag is the attribute `_z3_leaf`, as
DeepSpeed sets it; `zero/stage3_units.py` reads it with the config's `zero_optimization.leaf_module`.
Flag the modules before `zerospeed.initialize`: the units are chosen there.
"""
from __future__ import annotations

from torch import nn


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` itself is flagged as a ZeRO-3 leaf module."""
    return bool(getattr(model, "_z3_leaf", False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` (itself included) flagged as ZeRO-3 leaf modules, in `modules()` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Set or clear the flag on `model` itself."""
    model._z3_leaf = flag


def class_names(module: nn.Module) -> tuple[str, str]:
    """(class name, fully qualified class name) of `module`: the two spellings a leaf-module class is named by
    (here and in `zero_optimization.leaf_module.classes`)."""
    cls = type(module)
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def _set_by_class(model: nn.Module, leaf_module_classes, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    classes = list(leaf_module_classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be classes or class names (str), got {bad!r}")
    found = []
    for m in model.modules():
        if any(isinstance(m, c) if isinstance(c, type) else c in class_names(m) for c in classes):
            m._z3_leaf = flag
            found.append(m)
    if not found and raise_if_not_found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"no module of the classes {[getattr(c, '__name__', c) for c in classes]} in the model; "
                         f"its module classes are {present}")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of `model` that is an instance of one of `leaf_module_classes` (classes, or class names:
    plain or fully qualified) as a ZeRO-3 leaf module; returns the flagged modules. Raises ValueError when none
    matches (unless `raise_if_not_found=False`), TypeError for an entry that is neither a class nor a str."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clear the flag set by `set_z3_leaf_modules`; the same matching and errors."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)
