"""LAMB: You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
Algorithm 2 (ICLR 2020; arXiv 1904.00962).

The config's ``{"type": "Lamb", "params": {...}}`` builds this class, with DeepSpeed's ``FusedLamb``
arguments and defaults (lr 1e-3, bias_correction true, betas (0.9, 0.999), eps 1e-8,
eps_inside_sqrt false, weight_decay 0, max_coeff 10.0, min_coeff 0.01).

The trust ratio is a norm over a whole tensor, so the optimizer must see whole parameters: ZeRO
stages 1-3 hand it flat partition slices and are refused at config validation
(``config.optimizer.check_optimizer_for_stage``); use stage 0.

Differences from DeepSpeed's CUDA kernel, which folds the bias corrections into the step size
(``lr * sqrt(1 - b2^t) / (1 - b1^t)``) and computes the trust ratio on the uncorrected update: here
m and v are bias-corrected before the update and its norm, as Algorithm 2 writes it, so the
trust-ratio-normalised step does not carry the bias-correction factor (early steps differ, up to
0.32x at step 1 with the default betas, when the ratio is not clamped).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """LAMB (Algorithm 2 of You et al. 2020), for each parameter tensor x with gradient g at step t:

        m = b1 * m + (1 - b1) * g;      v = b2 * v + (1 - b2) * g^2
        m_hat = m / (1 - b1^t);         v_hat = v / (1 - b2^t)       (bias_correction=True)
        r = m_hat / (sqrt(v_hat) + eps)                              (eps_inside_sqrt: sqrt(v_hat + eps))
        u = r + weight_decay * x
        ratio = clamp(||x|| / ||u||, min_coeff, max_coeff), or 1 when ||x|| or ||u|| is 0
        x = x - lr * ratio * u

    Norms are L2 over the whole tensor. The clamp is DeepSpeed's "lamb coefficient" bound on the
    ratio (the paper's scaling function phi bounds ||x|| instead). State per parameter: ``step`` (0-d
    float32 tensor, as torch's optimizers keep it, so checkpoints can reshard it), ``exp_avg`` and
    ``exp_avg_sq`` (the parameter's shape and dtype) and ``lamb_coeff`` (0-d tensor, the last ratio;
    ``get_lamb_coeffs()`` lists them as floats, as DeepSpeed's FusedLamb does).

    Args (DeepSpeed's ``FusedLamb`` signature): lr > 0; bias_correction; betas in [0, 1); eps >= 0;
    eps_inside_sqrt; weight_decay >= 0; max_grad_norm must be 0 (clip with the config's top-level
    ``gradient_clipping``); max_coeff >= min_coeff >= 0; amsgrad must be false.

    Raises ValueError for an out-of-range argument, NotImplementedError for amsgrad=True or
    max_grad_norm > 0, RuntimeError for a sparse gradient.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False):
        if amsgrad:
            raise NotImplementedError("Lamb has no AMSGrad variant (DeepSpeed's FusedLamb refuses it too); "
                                      "set amsgrad=False")
        if max_grad_norm:
            raise NotImplementedError(f"Lamb(max_grad_norm={max_grad_norm}): clip gradients with the config's "
                                      "top-level 'gradient_clipping' instead, and leave max_grad_norm at 0")
        if not lr > 0.0:
            raise ValueError(f"Lamb lr must be > 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb betas must be two numbers in [0, 1), got {betas}")
        if not (eps >= 0.0 and weight_decay >= 0.0):
            raise ValueError(f"Lamb eps and weight_decay must be >= 0, got eps={eps}, weight_decay={weight_decay}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got min_coeff={min_coeff}, "
                             f"max_coeff={max_coeff}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB update of every parameter that has a ``.grad``; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                state["lamb_coeff"] = self._update(p, grad, state, group, beta1, beta2)
        return loss

    @staticmethod
    def _update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, beta1: float,
                beta2: float) -> torch.Tensor:
        exp_avg, exp_avg_sq, t = state["exp_avg"], state["exp_avg_sq"], int(state["step"].item())
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["bias_correction"]:
            m_hat, v_hat = exp_avg / (1 - beta1 ** t), exp_avg_sq / (1 - beta2 ** t)
        else:
            m_hat, v_hat = exp_avg, exp_avg_sq
        if group["eps_inside_sqrt"]:
            denom = (v_hat + group["eps"]).sqrt_()
        else:
            denom = v_hat.sqrt().add_(group["eps"])
        update = m_hat.div_(denom) if m_hat is not exp_avg else exp_avg / denom
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])
        w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
        ratio = (w_norm / u_norm).clamp_(group["min_coeff"], group["max_coeff"])
        ratio = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        p.add_(update.mul_(ratio), alpha=-group["lr"])
        return ratio

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio each parameter used at its last step, in param-group order (DeepSpeed's API)."""
        return [float(self.state[p]["lamb_coeff"]) for g in self.param_groups for p in g["params"]
                if "lamb_coeff" in self.state.get(p, {})]
