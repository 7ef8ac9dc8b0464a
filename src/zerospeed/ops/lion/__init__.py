"""`FusedLion` and `DeepSpeedCPULion`: DeepSpeed's names and signatures for `zerospeed.optim.Lion`
(Chen et al. 2023, Algorithm 1)."""
from __future__ import annotations

from zerospeed.optim.lion import Lion

__all__ = ["FusedLion", "DeepSpeedCPULion"]


class FusedLion(Lion):
    """``FusedLion(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True)``:
    ``zerospeed.optim.Lion``; set_grad_none makes ``zero_grad()`` set gradients to None (else zeros)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 set_grad_none: bool = True):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPULion(Lion):
    """``DeepSpeedCPULion(model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0,
    fp32_optimizer_states=True)``: ``zerospeed.optim.Lion`` (states take the parameter's dtype)."""

    def __init__(self, model_params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states
