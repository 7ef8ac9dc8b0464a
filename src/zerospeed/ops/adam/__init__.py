"""`FusedAdam` and `DeepSpeedCPUAdam` with DeepSpeed's constructor signatures, as `torch.optim.Adam`.

Both run torch's fused Adam kernel when every parameter is a contiguous floating-point tensor on a
device torch has the kernel for (CPU included: DeepSpeed's kernels are fused too), torch's default
implementation otherwise. ``adam_w_mode`` / ``adamw_mode`` true (default) means decoupled weight decay
(AdamW, Loshchilov & Hutter 2019); false means L2 regularisation added to the gradient (Adam).
Extra keyword arguments go to ``torch.optim.Adam`` (``foreach``, ``fused``, ``maximize``, ...).
"""
from __future__ import annotations

import torch

from zerospeed.optim.factory import _choose_implementation, _normalise_params, guard_fused_cpu

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True)`` over ``torch.optim.Adam``.

    set_grad_none: ``zero_grad()`` sets gradients to None (else fills them with zeros).
    Raises NotImplementedError for bias_correction=False (torch's Adam always corrects).
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, **torch_kwargs):
        if not bias_correction:
            raise NotImplementedError(f"{type(self).__name__}(bias_correction=False) is not supported: "
                                      "torch.optim.Adam always applies bias correction; leave it at True")
        torch_kwargs.setdefault("decoupled_weight_decay", adam_w_mode)
        param_arg, tensors = _normalise_params(params)
        chosen = _choose_implementation(torch.optim.Adam, torch_kwargs, param_arg, tensors, fused_cpu=True)
        super().__init__(param_arg, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         **torch_kwargs, **chosen)
        guard_fused_cpu(self)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
    eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True)``: the same
    update as ``FusedAdam`` on host parameters. Optimizer states take the parameter's dtype
    (fp32_optimizer_states is accepted; the engine's master weights are fp32 already)."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True, **torch_kwargs):
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adamw_mode, weight_decay=weight_decay, amsgrad=amsgrad, **torch_kwargs)
        self.fp32_optimizer_states = fp32_optimizer_states
