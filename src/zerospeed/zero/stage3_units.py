"""Choosing ZeRO-3 gather units: which parameters one all-gather fetches. Pure: no processes, no tensors moved.

DeepSpeed's ZeRO-3 fetches per leaf `nn.Module` (one all-gather per Linear), its most common
performance complaint; FSDP2 users wrap each transformer block. We pick blocks by default:

* a *block* is a child of an `nn.ModuleList` / `nn.Sequential` whose children (at least 2) are all
  of one class and hold parameters (transformer layers, ResNet stages of one kind, ...). Modules
  named by `zero_optimization.leaf_module` (classes / names / name suffixes) or flagged by
  `zerospeed.utils.set_z3_leaf_modules` are units too. Only the
  outermost match counts: a block's inner ModuleLists stay inside the block.
* the *root* unit gets every other trainable parameter, and also
  - parameters reachable from two units (tied / shared weights such as GPT-2's `wte.weight` ==
    `lm_head.weight`): the root is gathered for a whole forward + backward, so every use sees it;
  - parameters with fewer than `persistence_threshold` elements (`stage3_param_persistence_threshold`):
    too small for a collective of their own, they ride in the root's single all-gather per step
    (DeepSpeed keeps them whole on every rank; we keep them sharded at rest, so memory stays 16Ψ/N).
* frozen parameters (requires_grad=False) are not managed: they stay whole on every rank.
* every tile of a `zerospeed.zero.TiledLinear` is a unit of its own, also inside a block (the one case
  of nested units: the block then holds its other parameters, a parameter belongs to the innermost
  unit whose module holds it), so a very wide layer is gathered one tile at a time (ZeRO-Infinity's
  memory-centric tiling, Rajbhandari et al. 2021, §5.1.3).

Per step (no prefetch reuse): the root is all-gathered once, each block twice (forward and backward),
and every unit's gradient is reduce-scattered once, in a bucket with its neighbours (ZeRO,
Rajbhandari et al. 2020, §5.3 and §7.2.2).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..utils.z3_leaf_module import class_names, z3_leaf_module
from .tiling import TiledLinear

ROOT = ""  # the root unit's name


@dataclass(frozen=True)
class UnitPlan:
    """One gather unit. name: the unit module's name in `named_modules()` ("" = root).

    params: canonical parameter names (first name in `named_parameters()` order), in flat order.
    aliases: every name of each parameter (tied weights have several). numels: elements of each.
    """

    name: str
    params: tuple[str, ...]
    aliases: tuple[tuple[str, ...], ...]
    numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.numels)


def _matches_leaf(name: str, module: nn.Module, classes, names, suffixes) -> bool:
    return (z3_leaf_module(module) or name in names or any(name.endswith(s) for s in suffixes if s)
            or any(c in classes for c in class_names(module)))


def find_unit_modules(model: nn.Module, *, leaf_classes=(), leaf_names=(), leaf_name_suffixes=()) -> list[str]:
    """Names of the modules that become gather units (outermost first match), in `named_modules()` order.

    A module qualifies if it is a leaf module (by class name, qualified class name, module name or
    name suffix, or flagged `_z3_leaf` by `set_z3_leaf_modules`) or a child of an nn.ModuleList / nn.Sequential whose >= 2 children are all one class
    that holds parameters. The root module itself never qualifies. Every tile (`linears[o][i]`) of a
    `TiledLinear` qualifies too, also inside a module already chosen (nested units).
    """
    chosen: list[str] = []
    tiled: list[str] = []

    def inside(name: str, names: list[str]) -> bool:
        return any(name.startswith(c + ".") for c in names)

    for name, mod in model.named_modules():
        if name == "" or inside(name, tiled):
            continue
        if isinstance(mod, TiledLinear):  # its tiles are units, nested in an enclosing unit if any
            tiled.append(name)
            chosen.extend(f"{name}.linears.{o}.{i}" for o, row in enumerate(mod.linears) for i, t in enumerate(row)
                          if any(True for _ in t.parameters()))
            continue
        if inside(name, chosen):
            continue
        if _matches_leaf(name, mod, set(leaf_classes), set(leaf_names), tuple(leaf_name_suffixes)):
            chosen.append(name)
            continue
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            kids = list(mod.named_children())
            if len(kids) >= 2 and len({type(k) for _, k in kids}) == 1 and \
                    any(True for _ in kids[0][1].parameters()):
                prefix = name + "."
                chosen.extend(prefix + k for k, _ in kids if not inside(prefix + k, chosen))
    return chosen


def _owner(param_name: str, units: list[str]) -> str:
    """The innermost unit whose module holds `param_name` (ROOT if none)."""
    return max((u for u in units if param_name.startswith(u + ".")), key=len, default=ROOT)


def plan_units(model: nn.Module, *, persistence_threshold: int = 0, leaf_classes=(), leaf_names=(),
               leaf_name_suffixes=(), numel_of=None) -> list[UnitPlan]:
    """The gather units of `model`: the root unit first (possibly with no parameters), then the blocks
    in module order; blocks left without parameters are dropped.

    persistence_threshold: parameters with fewer elements join the root unit. numel_of: element count
    of a parameter (default `p.numel()`; `zerospeed.zero.Init` passes the full size of a partitioned
    parameter). Raises ValueError if persistence_threshold < 0.
    """
    numel_of = numel_of or (lambda p: p.numel())
    if persistence_threshold < 0:
        raise ValueError(f"persistence_threshold must be >= 0 elements, got {persistence_threshold}")
    units = find_unit_modules(model, leaf_classes=leaf_classes, leaf_names=leaf_names,
                              leaf_name_suffixes=leaf_name_suffixes)
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            names.setdefault(id(p), []).append(n)
            params[id(p)] = p
    members: dict[str, list[int]] = {u: [] for u in [ROOT, *units]}
    for key, ns in names.items():  # dict order = first appearance = named_parameters() order
        owners = {_owner(n, units) for n in ns}
        small = numel_of(params[key]) < persistence_threshold
        members[ROOT if len(owners) > 1 or small else owners.pop()].append(key)
    plans = []
    for u in [ROOT, *units]:
        keys = members[u]
        if u != ROOT and not keys:
            continue
        plans.append(UnitPlan(u, tuple(names[k][0] for k in keys), tuple(tuple(names[k]) for k in keys),
                              tuple(numel_of(params[k]) for k in keys)))
    return plans


def describe(plans: list[UnitPlan]) -> str:
    """A small table of units: name, parameters, elements."""
    rows = [f"{'unit':<24}{'params':>8}{'elements':>12}"]
    rows += [f"{(p.name or '<root>'):<24}{len(p.params):>8}{p.numel:>12}" for p in plans]
    return "\n".join(rows)
