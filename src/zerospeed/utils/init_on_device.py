"""`OnDevice`: build a model's tensors on a given device and floating dtype, as DeepSpeed's `deepspeed.OnDevice`."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full})


class _OnDeviceMode(TorchFunctionMode):
    def __init__(self, dtype: torch.dtype, device):
        super().__init__()
        self.dtype, self.device = dtype, device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in _FACTORIES:
            return func(*args, **kwargs)
        if kwargs.get("device") is None:
            kwargs["device"] = self.device
        out = func(*args, **kwargs)
        return out.to(self.dtype) if out.is_floating_point() and self.dtype is not None else out


class OnDevice:
    """Within the block, `torch.empty` / `zeros` / `ones` / `full` without a `device` create their tensors on
    `device`, and every floating-point tensor they create is cast to `dtype` - which is how `nn.Module`s create
    their parameters - as DeepSpeed's `OnDevice` (`deepspeed/utils/init_on_device.py`)::

        with zerospeed.OnDevice(dtype=torch.bfloat16, device="meta"):
            model = AutoModelForCausalLM.from_config(config)   # no memory used; init_inference(checkpoint=...) loads

    `enabled=False` makes the block a no-op. Integer tensors keep their dtype.
    """

    def __init__(self, dtype: torch.dtype, device="meta", enabled: bool = True):
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice(dtype={dtype}): give a floating-point dtype (float32, bfloat16, float16) "
                             "or None to keep the dtypes")
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._mode = None

    def __enter__(self):
        if self.enabled:
            self._mode = _OnDeviceMode(self.dtype, self.device)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            mode, self._mode = self._mode, None
            return mode.__exit__(*exc)
        return False
