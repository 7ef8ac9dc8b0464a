"""The sharding plan of a model as text: what `apply_tensor_parallel` would do at a tensor-parallel size.

Pure: reads only names and shapes (a model on the meta device works, no weights are touched) and needs no
process group. `zerospeed tp-plan` (plan_cli.py) prints it for a Hugging Face model type or config.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .autotp import check_divisible
from .layers import _full_module_parts
from .plan import TPPlan, plan_for_model

__all__ = ["LayerPlan", "plan_layers", "describe_plan"]


@dataclass(frozen=True)
class LayerPlan:
    """One linear layer under a plan at tensor-parallel size tp. kind: "column", "row" or "replicated";
    full_shape / local_shape: the weight's shape in the module's own orientation (nn.Linear [out, in],
    HF Conv1D [in, out]) whole and on one rank (local_shape None when the size does not split);
    blocks: fused projections split separately; sharded_numel / replicated_numel: the layer's
    parameter elements (weight and bias, full) that are split over the ranks / kept whole."""

    name: str
    kind: str
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...] | None
    blocks: int
    sharded_numel: int
    replicated_numel: int


def _linear_layers(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            yield name, module


def plan_layers(model: nn.Module, plan: TPPlan, tp: int) -> list[LayerPlan]:
    """A `LayerPlan` per linear layer (`nn.Linear`, HF `Conv1D`) of `model`, in module order, under `plan`
    at size `tp` (>= 1). Raises ValueError for tp < 1."""
    if tp < 1:
        raise ValueError(f"the tensor-parallel size must be >= 1, got {tp}")
    out = []
    for name, module in _linear_layers(model):
        w, b, transposed, *_ = _full_module_parts(module)
        rule = plan.rule_for(f"{name}.weight")
        kind = "replicated" if rule is None or rule.partition_type == "skip" else rule.partition_type
        blocks = rule.blocks if rule is not None else 1
        shape = tuple(w.shape)
        bias = 0 if b is None else b.numel()
        if kind == "replicated":
            out.append(LayerPlan(name, kind, shape, shape, 1, 0, w.numel() + bias))
            continue
        dim = (1 if transposed else 0) if kind == "column" else (0 if transposed else 1)
        local = None
        if shape[dim] % (blocks * tp) == 0:
            local = tuple(s // tp if i == dim else s for i, s in enumerate(shape))
        # a column layer splits its bias with the output features; a row layer adds its bias whole
        sharded, replicated = (w.numel() + bias, 0) if kind == "column" else (w.numel(), bias)
        out.append(LayerPlan(name, kind, shape, local, blocks, sharded, replicated))
    return out


def _count(n: float) -> str:
    return f"{n:,.0f}" if n < 1e6 else f"{n:,.0f} ({n / 1e6:.2f}M)" if n < 1e9 else f"{n:,.0f} ({n / 1e9:.2f}B)"


def describe_plan(model: nn.Module, tp_size: int, **plan_kwargs) -> str:
    """The tensor-parallel sharding plan of `model` at size `tp_size`, as a table.

    plan_kwargs: `plan_for_model`'s (`preset_model`, `partition_config`). One row per linear layer: name,
    row / column / replicated (with the fused block count), the weight's full shape and its shape on one
    rank; then totals over every parameter of the model (tied ones once): elements sharded (split over
    the ranks), replicated (embeddings, norms, unmatched layers, row-parallel biases) and held per rank
    (sharded / tp + replicated). Sizes that do not split (heads, widths, a weight dimension) are listed
    as problems at the end instead of raised. Needs no process group; a model on the meta device works.
    Raises ValueError when no plan applies to the model (`plan_for_model`'s message) or tp_size < 1.
    """
    plan = plan_for_model(model, **plan_kwargs)
    layers = plan_layers(model, plan, tp_size)
    total = sum(p.numel() for p in model.parameters())
    sharded = sum(lp.sharded_numel for lp in layers)
    replicated = total - sharded
    width = max([len("layer")] + [len(lp.name) for lp in layers])
    lines = [f"Tensor-parallel plan for {type(model).__name__} ({plan.source}), tp = {tp_size}",
             "rules (first match wins; parameter-name regexes):", *(f"  {r}" for r in plan.describe()),
             f"{'layer':<{width}}  {'kind':<14}{'full shape':<16}local shape"]
    unsplit: dict[tuple, list[str]] = {}  # (kind, full shape, blocks) -> layer names
    for lp in layers:
        kind = lp.kind + (f" x{lp.blocks}" if lp.blocks > 1 else "")
        local = "x".join(map(str, lp.local_shape)) if lp.local_shape is not None else "does not split"
        if lp.local_shape is None:
            unsplit.setdefault((lp.kind, lp.full_shape, lp.blocks), []).append(lp.name)
        lines.append(f"{lp.name:<{width}}  {kind:<14}{'x'.join(map(str, lp.full_shape)):<16}{local}")
    problems = [f"{len(names)} {kind}-parallel weight(s) {list(shape)} (e.g. {names[0]}): the sharded dimension does "
                f"not split into {blocks} block(s) x {tp_size} ranks" for (kind, shape, blocks), names in unsplit.items()]
    try:
        check_divisible(model, tp_size)
    except ValueError as exc:
        problems.insert(0, str(exc))
    per_rank = sharded / tp_size + replicated
    lines += [f"parameters: {_count(total)}",
              f"  sharded:    {_count(sharded)} ({100 * sharded / max(total, 1):.1f}%), {_count(sharded / tp_size)} per rank",
              f"  replicated: {_count(replicated)} ({100 * replicated / max(total, 1):.1f}%), on every rank",
              f"  per rank:   {_count(per_rank)} ({per_rank / max(total, 1):.3f} of the model)"]
    if problems:
        lines += [f"problems at tp = {tp_size}:", *(f"  {p}" for p in problems)]
    return "\n".join(lines)
