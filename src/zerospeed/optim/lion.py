"""Lion: Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 1.

The config's ``{"type": "Lion", "params": {"lr": ..., "betas": [b1, b2], "weight_decay": ...}}`` builds
this class, with DeepSpeed's ``FusedLion`` defaults (lr 1e-3, betas (0.9, 0.999), weight_decay 0; the
paper suggests betas (0.9, 0.99) and a 3-10x smaller lr than AdamW's).

Elementwise (no norms over a tensor), so it gives the same numbers on a whole parameter and on any
slice of it: it runs at every ZeRO stage, where the optimizer sees flat partition rows.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion (EvoLved Sign Momentum), Algorithm 1 of Chen et al. 2023, per element of each tensor:

        c      = b1 * m + (1 - b1) * g            # interpolation, the update direction
        theta -= lr * (sign(c) + weight_decay * theta)   # decoupled weight decay, as AdamW
        m      = b2 * m + (1 - b2) * g            # the momentum tracked for the next step

    sign(0) = 0. State per parameter: ``exp_avg`` (m, the parameter's shape and dtype, zero at the
    first step). Arithmetic runs in the parameter's dtype.

    Args:
        params: tensors or param-group dicts.
        lr: learning rate (> 0). betas: (b1, b2), each in [0, 1). weight_decay: >= 0.

    Raises ValueError for an out-of-range hyper-parameter and RuntimeError for a sparse gradient.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0):
        if not lr > 0.0:
            raise ValueError(f"Lion lr must be > 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion betas must be two numbers in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lion weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One Lion update of every parameter that has a ``.grad``; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                # each line rounds as Algorithm 1 writes it (no fused multiply-adds): bit-exact with it
                update = (exp_avg * beta1).add_(grad * (1 - beta1)).sign_()
                if decay != 0:
                    update.add_(p * decay)
                p.sub_(update.mul_(lr))
                exp_avg.mul_(beta2).add_(grad * (1 - beta2))
        return loss
