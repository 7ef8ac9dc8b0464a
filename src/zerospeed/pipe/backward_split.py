"""A stage's backward as two passes: input gradients first, weight gradients later (zero-bubble schedules).

Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §2: the backward of a stage splits into B, the gradient
of the stage's input (what the previous stage waits for), and W, the gradients of its weights (which nothing
waits for until the optimizer step), so W can fill the pipeline's bubbles.

How: the stage's forward runs as *segments* (one layer, or one activation-checkpointed block, each) whose
inputs are detached leaves (`PipelineModule.forward_segments`). B walks the segments from last to first,
taking each segment's input gradient from its output gradient with `torch.autograd.grad(..., inputs=segment
inputs)`, which computes no weight gradient. W then runs `torch.autograd.backward(..., inputs=parameters)`,
which computes only weight gradients and accumulates them into `.grad` through autograd's own AccumulateGrad,
so post-accumulate-grad hooks (the ZeRO reduction) fire as in a fused backward.

W from a segment's output would recompute the segment's activation gradients, which B already computed
(a ReLU after a Linear; a transformer block's whole chain). So B also keeps the gradient arriving at each
*intermediate* node: the first node, on the way from a parameter towards the output, that also depends on
the segment's input (a Linear's AddmmBackward, where the weight meets the activation); W then starts from
those nodes, one `backward` per group of parameters sharing intermediates, and computes only the weight
branches: together B and W do the fused backward's arithmetic.

A linear layer's W (an intermediate that is `addmm(bias, x, weight.t())` or `mm(x, weight.t())` of two
parameters, not under activation checkpointing) is one GEMM accumulating into `.grad`,
`weight.grad.addmm_(dy.t(), x)` (bias: `+= dy.sum(0)`), then the parameters' post-accumulate-grad hooks;
autograd's AccumulateGrad would write the product to a fresh tensor and add it in a second pass over the
gradient, which on a CPU reading ~17 GB/s costs more than the product (8 Linear(1024, 1536) at 32 rows:
10.0 ms against 22.3). The first gradient of a step is assigned as AccumulateGrad would (`mm`, the same
bits); later ones differ from `grad += mm(...)` by rounding only (in bf16, one rounding instead of two). This is
torch.distributed.pipelining's `stage_backward_input` / `stage_backward_weight` algorithm (its
`get_param_groups`), redone with public autograd calls (`Node.register_prehook`, `GradientEdge`) and with W
accumulating into `.grad` (through autograd, or the linear GEMM above), not assigning it, so the hooks fire. A parameter whose gradient does
not depend on the segment's input (none, on the first stage's first segment) makes W start from the output.

The values equal a fused backward's (the same products, summed in the same order per parameter; accumulating
over micro-batches, to rounding).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .p2p import Activation, as_tuple

__all__ = ["Segment", "LinearWeights", "PendingWeights", "detach_input", "backward_fused", "backward_input",
           "backward_weight"]


@dataclass
class Segment:
    """One piece of a stage's forward: `inputs` are the detached leaves it started from (as a tuple, the
    floating ones requiring grad), `output` what it returned, `params` the trainable parameters it used,
    `recompute`: it runs under activation checkpointing (its saved tensors are recomputed on unpacking, so W
    goes through autograd)."""
    inputs: tuple
    output: Activation
    params: list[torch.nn.Parameter]
    recompute: bool = False


@dataclass
class LinearWeights:
    """One linear layer's pending W: `x` its input (rows, in_features), `dy` the gradient of its output
    (rows, out_features); weight (out_features, in_features), bias (out_features,) or None."""
    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None
    x: torch.Tensor
    dy: torch.Tensor

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]


@dataclass
class PendingWeights:
    """What B leaves for W: per parameter group, where W starts (output tensors or intermediate gradient
    edges), the gradients there, and the parameters; or a `LinearWeights`."""
    items: list = field(default_factory=list)


def _reverse_edges(roots: list) -> dict:
    """node -> the nodes that take its output (the graph from the outputs' grad_fns, edges reversed)."""
    parents: dict = {}
    todo = [n for n in roots if n is not None]
    for n in todo:
        parents.setdefault(n, [])
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(node)
    return parents


def _closure(starts: list, parents: dict, stop: set) -> tuple[set, set]:
    """(nodes reached from `starts` following `parents`, without entering `stop`; the `stop` nodes met)."""
    seen, met, todo = set(starts), set(), list(starts)
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen, met


def _weight_groups(outs: list[torch.Tensor], inputs: list[torch.Tensor], params: list) -> list | None:
    """[(intermediate nodes, parameters)] whose weight gradients can start from the intermediates, or None
    when some parameter's gradient does not depend on the inputs (W then starts from the outputs)."""
    parents = _reverse_edges([t.grad_fn for t in outs])
    input_nodes = [get_gradient_edge(t).node for t in inputs]
    dependent, _ = _closure([n for n in input_nodes if n in parents], parents, set())
    groups: list[tuple[set, list]] = []
    for p in params:
        node = get_gradient_edge(p).node
        if node not in parents:
            continue  # unused in this segment: no gradient
        _, met = _closure([node], parents, dependent)
        if not met:
            return None
        joined = [g for g in groups if g[0] & met]
        for g in joined:
            groups.remove(g)
            met |= g[0]
        groups.append((met, [q for g in joined for q in g[1]] + [p]))
    return groups


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
    first segment's inputs, set as their `.grad` and returned as a tuple (None if they need none); what W
    needs is kept for `backward_weight` (the gradients at each segment's intermediate nodes, a linear layer's
    as a `LinearWeights`; the output gradients where a parameter's gradient does not depend on the segment's
    input). Each segment's graph is kept only if W may need it (it has parameters)."""
    pending = PendingWeights()
    for seg in reversed(segments):
        outs, gs = _differentiable(seg.output, grads)
        wanted = [t for t in seg.inputs if torch.is_tensor(t) and t.requires_grad]
        groups = _weight_groups(outs, wanted, seg.params) if seg.params and outs and wanted else None
        if groups is None and seg.params and outs:
            pending.items.append((outs, gs, seg.params))
        if not wanted:
            grads = None
            continue
        saved: dict = {}
        handles = [n.register_prehook(functools.partial(_keep, saved, n)) for g in groups or () for n in g[0]]
        try:
            dx = torch.autograd.grad(outs, wanted, gs, retain_graph=bool(seg.params), allow_unused=True) if outs \
                else [None] * len(wanted)
        finally:
            for h in handles:
                h.remove()
        for nodes, params in groups or ():
            linear = None if seg.recompute or len(nodes) != 1 else _as_linear(next(iter(nodes)), saved, params)
            if linear is not None:
                pending.items.append(linear)
                continue
            edges = [(GradientEdge(n, i), g) for n in nodes for i, g in enumerate(saved.get(n, ())) if g is not None]
            if edges:
                pending.items.append(([e for e, _ in edges], [g for _, g in edges], params))
        it = iter(dx)
        grads = tuple(next(it) if torch.is_tensor(t) and t.requires_grad else None for t in seg.inputs)
    if segments:
        for t, g in zip(segments[0].inputs, grads or ()):
            if g is not None:
                t.grad = g
    return pending, grads


def _keep(saved: dict, node, grad_outputs):
    """A prehook: remember the gradients arriving at `node` during B (it returns None: nothing changes)."""
    saved[node] = grad_outputs


def _accumulate_grad_variable(node):
    """The parameter an AccumulateGrad node accumulates into (None for any other node)."""
    return node.variable if type(node).__name__ == "AccumulateGrad" else None


def _as_linear(node, saved: dict, params: list) -> LinearWeights | None:
    """`_linear_weights`, or None if this torch names an autograd attribute it reads differently (the saved
    tensors of the autograd mechanics notes, `_saved_mat1` etc.; `Tensor._post_accumulate_grad_hooks`): W then
    goes through autograd, as before (the unit test counting one-GEMM weight passes would say so)."""
    try:
        return _linear_weights(node, saved, params)
    except AttributeError:
        return None


def _linear_weights(node, saved: dict, params: list) -> LinearWeights | None:
    """`node` as a linear layer's W (see the module docstring), or None when it is anything else: another op,
    alpha/beta not 1, a weight reached through more than a transpose (a cast under autocast), parameters other
    than the group's, tensor hooks on them (`register_hook`: they must see the gradient), a 2-D shape or dtype
    that does not match."""
    kind = type(node).__name__
    if kind == "AddmmBackward0" and node._saved_alpha == 1 and node._saved_beta == 1:
        bias_node, weight_node, x = node.next_functions[0][0], node.next_functions[2][0], node._saved_mat1
    elif kind == "MmBackward0":
        bias_node, weight_node, x = None, node.next_functions[1][0], node._saved_self
    else:
        return None
    if type(weight_node).__name__ != "TBackward0":
        return None
    weight = _accumulate_grad_variable(weight_node.next_functions[0][0])
    bias = None if bias_node is None else _accumulate_grad_variable(bias_node)
    dy = (saved.get(node) or (None,))[0]
    if weight is None or (bias_node is not None and bias is None) or dy is None or x is None:
        return None
    item = LinearWeights(weight, bias, x, dy)
    mine = item.params
    if len(params) != len(mine) or any(not any(p is q for q in mine) for p in params):
        return None
    if any(getattr(p, "_backward_hooks", None) for p in mine) or not hasattr(weight, "_post_accumulate_grad_hooks"):
        return None
    if x.dim() != 2 or dy.dim() != 2 or x.dtype != weight.dtype or dy.dtype != weight.dtype \
            or tuple(weight.shape) != (dy.shape[1], x.shape[1]):
        return None
    return item


def _accumulate(p: torch.nn.Parameter, make, add) -> None:
    """p.grad = make() if it has none, else add(p.grad) in place; then p's post-accumulate-grad hooks, as
    AccumulateGrad runs them (the ZeRO reduction's; `Tensor._post_accumulate_grad_hooks`, where
    `register_post_accumulate_grad_hook` keeps them)."""
    with torch.no_grad():
        if p.grad is None:
            p.grad = make()
        else:
            add(p.grad)
    for hook in (p._post_accumulate_grad_hooks or {}).values():
        hook(p)


def _linear_weight_pass(item: LinearWeights) -> None:
    x, dy = item.x, item.dy
    _accumulate(item.weight, lambda: torch.mm(dy.t(), x), lambda g: g.addmm_(dy.t(), x))
    if item.bias is not None:
        _accumulate(item.bias, lambda: dy.sum(0), lambda g: g.add_(dy.sum(0)))


def _params_of(item) -> list:
    return item.params if isinstance(item, LinearWeights) else item[2]


def _contributions(item) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, its gradient from this item) without accumulating anything (no hook fires)."""
    if isinstance(item, LinearWeights):
        return list(zip(item.params, (torch.mm(item.dy.t(), item.x), item.dy.sum(0))))
    starts, gs, params = item
    grads = torch.autograd.grad(starts, params, gs, retain_graph=True, allow_unused=True)
    return [(p, g) for p, g in zip(params, grads) if g is not None]


def backward_weight(pending: PendingWeights) -> None:
    """W: the weight gradients B left pending, accumulated into `.grad` (hooks fire), one group after another
    (each from its own starting points, so no group's backward walks into another's). A parameter used by more
    than one segment (a weight tied within the stage: an embedding and the head) gets its contributions summed
    first and accumulated once, so its hooks fire once, as in a fused backward (where autograd sums them)."""
    counts: dict[int, int] = {}
    for item in pending.items:
        for p in _params_of(item):
            counts[id(p)] = counts.get(id(p), 0) + 1
    summed: dict[int, list] = {}  # id -> [parameter, summed gradient] of the parameters used more than once
    for item in pending.items:
        if all(counts[id(p)] == 1 for p in _params_of(item)):
            if isinstance(item, LinearWeights):
                _linear_weight_pass(item)
            else:
                starts, gs, params = item
                torch.autograd.backward(starts, gs, inputs=params, retain_graph=True)
            continue
        for p, g in _contributions(item):
            if counts[id(p)] == 1:
                _accumulate(p, lambda g=g: g, lambda acc, g=g: acc.add_(g))
            elif id(p) in summed:
                summed[id(p)][1] = summed[id(p)][1] + g
            else:
                summed[id(p)] = [p, g]
    for p, g in summed.values():
        _accumulate(p, lambda g=g: g, lambda acc, g=g: acc.add_(g))
    pending.items.clear()
