"""`MixedPrecisionPolicy`: which dtype parameters, gradient communication and master weights use.

One frozen value object, built once by `initialize()` from the `fp16` / `bf16` sections and
`communication_data_type`, and handed to the ZeRO strategy (DESIGN.md rule 1; FSDP2's
`MixedPrecisionPolicy(param_dtype, reduce_dtype, ...)` has the same shape). Every stage composes
with it instead of having a subclass per precision (rule 8).

| precision | param_dtype | reduce_dtype                             | master_dtype |
| --------- | ----------- | ---------------------------------------- | ------------ |
| fp32      | fp32        | communication_data_type or fp32          | fp32 (the parameters themselves) |
| bf16      | bf16        | communication_data_type or bf16          | fp32         |
| fp16      | fp16        | communication_data_type or fp16          | fp32         |

reduce_dtype follows DeepSpeed's `DeepSpeedEngine.communication_data_type`: the config value if
set, else the model's dtype (fp16 / bf16 / fp32). So by default gradients travel in 2 bytes under
mixed precision (half the bytes of fp32), and `"communication_data_type": "fp32"` trades bandwidth
for an fp32 sum. Gradients are *accumulated* in fp32 wherever a strategy keeps them across
micro-steps (see each stage), and always unscaled, clipped and applied in fp32 on the masters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """param_dtype: the model's parameters and buffers (forward / backward compute).
    reduce_dtype: gradient collectives (all-reduce, reduce-scatter). master_dtype: the weights the
    optimizer updates and its states; fp32 in every supported mode."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "master_dtype"):
            if getattr(self, name) not in _DTYPES.values():
                raise ValueError(f"MixedPrecisionPolicy.{name} must be torch.float32, bfloat16 or float16, "
                                 f"got {getattr(self, name)}")
        if self.master_dtype != torch.float32:
            raise ValueError(f"MixedPrecisionPolicy.master_dtype must be torch.float32 (low-precision master "
                             f"weights are not supported), got {self.master_dtype}")

    @classmethod
    def from_precision(cls, precision: str, communication_data_type: str | None = None) -> MixedPrecisionPolicy:
        """The policy for a training precision ("fp32", "bf16", "fp16") and the config's
        `communication_data_type` (None = the parameter dtype, as DeepSpeed). Raises ValueError."""
        if precision not in _DTYPES:
            raise ValueError(f"precision must be one of {sorted(_DTYPES)}, got {precision!r}")
        if communication_data_type is not None and communication_data_type not in _DTYPES:
            raise ValueError(f"communication_data_type must be one of {sorted(_DTYPES)} or None, "
                             f"got {communication_data_type!r}")
        param = _DTYPES[precision]
        reduce = _DTYPES[communication_data_type] if communication_data_type else param
        return cls(param_dtype=param, reduce_dtype=reduce, master_dtype=torch.float32)

    @property
    def mixed(self) -> bool:
        """True when the parameters are low precision and separate fp32 master weights exist."""
        return self.param_dtype != self.master_dtype

    @property
    def name(self) -> str:
        """"fp32", "bf16" or "fp16" (the parameter dtype)."""
        return next(k for k, v in _DTYPES.items() if v == self.param_dtype)

    def cast_module(self, module: nn.Module) -> dict[int, torch.Tensor]:
        """Cast `module`'s floating-point parameters and buffers to `param_dtype`, in place (the
        `nn.Parameter` objects stay the same; only their `.data` changes), as DeepSpeed's
        `module.half()` / `.bfloat16()` does.

        Returns {id(parameter): its original tensor} for every trainable parameter that was cast,
        so strategies can build fp32 master weights from the exact original values (casting back
        from bf16 would lose 16 bits of mantissa). The caller drops the dict once the strategy is
        built. Empty when nothing needs casting (fp32)."""
        if self.param_dtype == torch.float32:
            return {}
        originals: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for p in module.parameters():
                if p.is_floating_point() and p.dtype != self.param_dtype:
                    if p.requires_grad:
                        originals[id(p)] = p.data
                    p.data = p.data.to(self.param_dtype)
            for m in module.modules():
                for key, b in m._buffers.items():
                    if b is not None and b.is_floating_point() and b.dtype != self.param_dtype:
                        m._buffers[key] = b.to(self.param_dtype)
        return originals
