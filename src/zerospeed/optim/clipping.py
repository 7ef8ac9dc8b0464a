"""Global gradient norm and clipping."""
from __future__ import annotations

import torch


def clip_and_norm(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> float:
    """Return the global `norm_type`-norm of the gradients of `params`; clip them to `max_norm` if it is > 0.

    Same result as `torch.nn.utils.clip_grad_norm_` (which it calls into). Parameters without a
    gradient are skipped. Non-finite norms are returned as-is (the caller decides to skip a step).
    """
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=norm_type, foreach=True)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm, foreach=True)
    return float(norm)
