"""A stage's backward as two passes: input gradients first, weight gradients later (zero-bubble schedules).

Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §2: the backward of a stage splits into B, the gradient
of the stage's input (what the previous stage waits for), and W, the gradients of its weights (which nothing
waits for until the optimizer step), so W can fill the pipeline's bubbles.

How: the stage's forward runs as *segments* (one layer, or one activation-checkpointed block, each) whose
inputs are detached leaves (`PipelineModule.forward_segments`). B walks the segments from last to first,
taking each segment's input gradient from its output gradient with `torch.autograd.grad(..., inputs=segment
inputs)`, which computes no weight gradient; it keeps each segment's output gradient. W then runs
`torch.autograd.backward(segment output, output gradient, inputs=segment parameters)` per segment, which
computes only weight gradients and accumulates them into `.grad` through autograd's own AccumulateGrad, so
post-accumulate-grad hooks (the ZeRO reduction) fire as in a fused backward. Both passes together do the
fused backward's arithmetic, except inside a segment holding several weighted operations in a chain (a
transformer block): there W recomputes the segment's internal activation gradients (B pruned the weight
branches, W cannot reuse B's internal gradients). A list of single Linear layers costs nothing extra.
torch.distributed.pipelining instead splits at autograd-graph nodes (`_backward.stage_backward_input`),
which avoids that recomputation at the price of walking the graph each micro-batch; these are public
autograd calls only.

The values equal a fused backward's (the same products, summed in the same order per parameter).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .p2p import Activation, as_tuple

__all__ = ["Segment", "PendingWeights", "detach_input", "backward_fused", "backward_input", "backward_weight"]


@dataclass
class Segment:
    """One piece of a stage's forward: `inputs` are the detached leaves it started from (as a tuple, the
    floating ones requiring grad), `output` what it returned, `params` the trainable parameters it used."""
    inputs: tuple
    output: Activation
    params: list[torch.nn.Parameter]


@dataclass
class PendingWeights:
    """What B leaves for W: per segment, the differentiable outputs, their gradients and the parameters."""
    items: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.nn.Parameter]]] = field(default_factory=list)


def detach_input(x: Activation) -> Activation:
    """`x` with every tensor detached; the floating ones become leaves requiring grad (a segment's input)."""
    def one(t):
        return t.detach().requires_grad_(t.is_floating_point()) if torch.is_tensor(t) else t
    return tuple(one(t) for t in x) if isinstance(x, tuple) else one(x)


def _differentiable(output: Activation, grads) -> tuple[list[torch.Tensor], list]:
    """The (output tensor, gradient) pairs autograd can use: tensors with a graph, and a gradient (None is
    kept for a 0-d output, e.g. a loss, which autograd seeds with 1)."""
    outs, gs = [], []
    grads = (None,) if grads is None else as_tuple(grads)
    for t, g in zip(as_tuple(output), grads):
        if torch.is_tensor(t) and t.requires_grad and (g is not None or t.dim() == 0):
            outs.append(t)
            gs.append(g)
    return outs, gs


def backward_fused(output: Activation, grads) -> None:
    """The ordinary backward of a stage (`output` the loss when `grads` is None)."""
    outs, gs = _differentiable(output, grads)
    if outs:
        torch.autograd.backward(outs, gs)


def backward_input(segments: list[Segment], grads) -> tuple[PendingWeights, tuple | None]:
    """B: from the gradient of the last segment's output (None: the output is the loss), the gradient of the
    first segment's inputs, set as their `.grad` and returned as a tuple (None if they need none); the
    per-segment output gradients are kept for `backward_weight`. Each segment's graph is kept only if W
    will need it (the segment has parameters)."""
    pending = PendingWeights()
    for seg in reversed(segments):
        outs, gs = _differentiable(seg.output, grads)
        if seg.params and outs:
            pending.items.append((outs, gs, seg.params))
        wanted = [t for t in seg.inputs if torch.is_tensor(t) and t.requires_grad]
        if not wanted:
            grads = None
            continue
        dx = torch.autograd.grad(outs, wanted, gs, retain_graph=bool(seg.params), allow_unused=True) if outs \
            else [None] * len(wanted)
        it = iter(dx)
        grads = tuple(next(it) if torch.is_tensor(t) and t.requires_grad else None for t in seg.inputs)
    if segments:
        for t, g in zip(segments[0].inputs, grads or ()):
            if g is not None:
                t.grad = g
    return pending, grads


def backward_weight(pending: PendingWeights) -> None:
    """W: the weight gradients of every segment B recorded, accumulated into `.grad` (hooks fire)."""
    for outs, gs, params in pending.items:
        torch.autograd.backward(outs, gs, inputs=params)
    pending.items.clear()
