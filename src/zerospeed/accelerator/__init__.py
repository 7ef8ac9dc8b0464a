"""`zerospeed.accelerator.get_accelerator()`: DeepSpeed's `deepspeed.accelerator.get_accelerator()`.

    from zerospeed.accelerator import get_accelerator
    device = get_accelerator().device_name(local_rank)     # "cpu", "cuda:0", ...
    backend = get_accelerator().communication_backend_name()  # "gloo", "nccl", ...

The device type is chosen once per process: $ZEROSPEED_ACCELERATOR (or DeepSpeed's $DS_ACCELERATOR)
if set, else torch's current accelerator (`torch.accelerator.current_accelerator()`), else "cpu".
"""
from __future__ import annotations

import os

import torch

from .accelerator import Accelerator

__all__ = ["Accelerator", "get_accelerator", "set_accelerator", "is_current_accelerator_supported"]

_current: Accelerator | None = None


def _detect() -> str:
    chosen = os.environ.get("ZEROSPEED_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if chosen:
        chosen = chosen.strip().lower()
        if chosen != "cpu":
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            if acc is None or acc.type != chosen:
                found = acc.type if acc is not None else "none (CPU only)"
                raise ValueError(f"ZEROSPEED_ACCELERATOR/DS_ACCELERATOR={chosen!r} but torch's accelerator on this "
                                 f"machine is {found}; unset the variable or set it to 'cpu'")
        return chosen
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"


def get_accelerator() -> Accelerator:
    """The process's `Accelerator` (created on first call; see the module docstring for the choice).
    Raises ValueError when $ZEROSPEED_ACCELERATOR/$DS_ACCELERATOR names a device type torch does not have."""
    global _current
    if _current is None:
        _current = Accelerator(_detect())
    return _current


def set_accelerator(accelerator: Accelerator) -> None:
    """Replace the process's accelerator (DeepSpeed's `set_accelerator`)."""
    global _current
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"set_accelerator needs a zerospeed.accelerator.Accelerator, got {type(accelerator).__name__}")
    _current = accelerator


def is_current_accelerator_supported() -> bool:
    """True: every device type torch supports is supported here."""
    return True
