"""`FusedLamb`: DeepSpeed's name and signature for `zerospeed.optim.Lamb` (You et al. 2020, Algorithm 2)."""
from __future__ import annotations

from zerospeed.optim.lamb import Lamb

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    """``FusedLamb(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    eps_inside_sqrt=False, weight_decay=0.0, max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01,
    amsgrad=False)``: exactly ``zerospeed.optim.Lamb`` (see it for the update and its errors)."""
