"""ZeRO-3 `nn.Linear` layers whose weight gradient goes into recycled host memory (`memory_efficient_linear`).

Autograd's linear backward allocates every weight gradient afresh, [out_features, in_features] in the
parameter dtype: 67 MB for one fp32 2048 x 8192 MLP weight. Above glibc's 32 MiB mmap ceiling each is a new
mapping per backward whose pages the kernel faults in and zeroes (GPT 4 x 2048, ZeRO-3 fp32, world 2: 185,000
minor faults per step, all of them these gradients; 1.2 GB of fresh pages per step for 6 layers with NVMe
offload; bench/README.md, session 30). ZeRO-3 copies a gradient into its reduce-scatter bucket and drops it
(`ShardedUnit.take_grads`), so its memory can serve the next layer's weight gradient of the same size.

`RecycledGradLinear` computes what autograd's linear computes, with the same matrix products in the same
layouts (forward `F.linear`; backward dx = dy W, dW = dy^T x, db = the sum of dy over the leading dims, for
x of shape [..., in] and dy of shape [..., out]), and writes dW into a buffer of a `RecycledBuffers` cache
(`offload.hostmem`), which hands the storage out again once nothing else references it. It is
differentiable once: a double backward (`create_graph=True` through these layers, e.g. a gradient penalty)
raises; set `"memory_efficient_linear": false` for that.

DeepSpeed's `zero_optimization.memory_efficient_linear` (default true) replaces `torch.nn.functional.linear`
process-wide with its own autograd function (`LinearFunctionForZeroStage3`, so autograd holds no gathered
weights). Here the same key installs `RecycledGradLinear` as the forward of the modules of exactly type
`nn.Linear` in a ZeRO-3 model whose weights live on the host (subclasses, functional calls and accelerator
devices keep their own paths; an accelerator's caching allocator already reuses memory), and
`RecycledGradLinears.remove` restores them.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..offload.aio import HOST
from ..offload.hostmem import RecycledBuffers

__all__ = ["RecycledGradLinear", "RecycledGradLinears"]


class RecycledGradLinear(torch.autograd.Function):
    """y = x W^T + b (`F.linear`) whose weight gradient is written into `cache.empty(...)`.

    x: [..., in], weight: [out, in], bias: [out] or None; returns [..., out]. Backward: dx [..., in],
    dW [out, in] (a recycled buffer), db [out]."""

    @staticmethod
    def forward(ctx, x, weight, bias, cache):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.cache = bias is not None, cache
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy2.mm(weight).view(*dy.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            dw = ctx.cache.empty(weight.numel(), weight.dtype).view(weight.shape)
            torch.mm(dy2.t(), x.reshape(-1, x.shape[-1]), out=dw)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None


class RecycledGradLinears:
    """Install `RecycledGradLinear` on the exact-type `nn.Linear` modules of `module` whose weight belongs to one
    of `units` (the ZeRO-3 `ShardedUnit`s) and lives on the host. The cache keeps at most one unit's worth of
    those weight gradients idle (`max_idle_bytes`: the largest sum over a unit; `per_size`: the most weights
    of one byte size in a unit, e.g. an MLP's two 4h x h matrices), so the resident set grows by at most what
    one unit's gradients already took at the peak. `remove()` gives the modules their class's forward back."""

    def __init__(self, module: nn.Module, units) -> None:
        # (unit, bytes of the full weight): a sharded parameter's own .data is empty while its unit is released
        unit_of = {id(sp.param): (u.index, sp.numel * sp.param.element_size()) for u in units for sp in u.params}
        self.modules = [m for m in module.modules() if type(m) is nn.Linear and id(m.weight) in unit_of
                        and m.weight.device.type == HOST.type and "forward" not in vars(m)]
        sizes: dict[int, Counter] = {}
        for m in self.modules:
            index, nbytes = unit_of[id(m.weight)]
            sizes.setdefault(index, Counter())[nbytes] += 1
        idle = max((sum(n * c for n, c in count.items()) for count in sizes.values()), default=0)
        per_size = max((c for count in sizes.values() for c in count.values()), default=1)
        self.cache = RecycledBuffers(idle, per_size=per_size)
        for m in self.modules:
            m.forward = _Forward(m, self.cache)

    def remove(self) -> None:
        for m in self.modules:
            if isinstance(vars(m).get("forward"), _Forward):
                del m.forward
        self.modules = []


class _Forward:
    """The bound forward installed on one module (a class, so `remove` recognises its own)."""

    def __init__(self, module: nn.Linear, cache: RecycledBuffers):
        self.module, self.cache = module, cache

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return RecycledGradLinear.apply(x, self.module.weight, self.module.bias, self.cache)

    def __reduce__(self):  # a deep copy or pickle of the model gets the class's forward (no shared cache)
        return _class_forward, (self.module,)


def _class_forward(module: nn.Linear):
    return nn.Linear.forward.__get__(module)
