"""DeepSpeed's `deepspeed.moe.utils`: tell expert parameters from shared ones, and split optimizer
parameter groups so that expert parameters get groups of their own.

An expert parameter is one `Experts` marked with `allreduce = False` (and `group_name`, the name of its
expert-data-parallel group, e.g. "ep_size_2"): its gradient must be averaged over that group only, not
over every data-parallel rank, so an optimizer needs it in a separate group.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["has_moe_layers", "is_moe_param", "split_params_into_shared_and_expert_params",
           "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
           "is_moe_param_group", "configure_moe_param_groups"]


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(True, num_experts of the first MoE layer) if `m` contains a `zerospeed.moe.layer.MoE`, else (False, 0)."""
    from .layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (`param.allreduce` exists and is False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
        params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(shared parameters, expert parameters), each in the input order."""
    shared = [p for p in params if not is_moe_param(p)]
    experts = [p for p in params if is_moe_param(p)]
    return shared, experts


def split_params_grads_into_shared_and_expert_params(
        group: list[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(gradients of shared parameters, gradients of expert parameters), each cast to its parameter's
    dtype; parameters without a gradient are skipped (for norms in clipping / overflow checks)."""
    shared: list[torch.Tensor] = []
    experts: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (experts if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, experts


def _as_group_list(param_groups) -> list[dict[str, Any]]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        return list(param_groups)
    raise ValueError(f"Unknown param group type of {type(param_groups)}: pass a dict, or a list or tuple of dicts "
                     "(torch optimizer parameter groups)")


def _chunks(params: list[nn.Parameter], max_group_size: int | float | None) -> list[list[nn.Parameter]]:
    """Consecutive runs of params of at most max_group_size elements each (a parameter larger than that
    gets a run of its own); one run without a limit; no empty run."""
    if max_group_size is None:
        return [params]
    runs: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if runs and size + p.numel() <= max_group_size:
            runs[-1].append(p)
            size += p.numel()
        else:
            runs.append([p])
            size = p.numel()
    return runs


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
        max_group_size: int | float | None = 178956971) -> list[dict[str, Any]]:
    """Optimizer parameter groups with the expert parameters moved into groups of their own.

    Returns the input groups, each without its expert parameters, followed, for each input group and each
    expert group name (`param.group_name`) found in any group, by a copy of that group's options with
    `"name": <group_name>`, `"moe": True` and its expert parameters of that name, cut into runs of at most
    max_group_size elements (None: no limit). As DeepSpeed, a group left with no parameters is kept.

    Differences from DeepSpeed 0.19.8, where it fails or loses parameters: groups are told apart by
    position, not by their "name" (DeepSpeed raises KeyError for a group without "name" once an expert
    parameter exists, and merges groups sharing a name into the last one's options); "params" may be
    any iterable, e.g. `model.parameters()` (DeepSpeed iterates it twice, so a generator loses every
    parameter); the input dicts are not modified; no empty expert group is emitted (DeepSpeed adds
    one when the first parameter alone exceeds max_group_size).
    """
    groups = [{**g, "params": list(g["params"])} for g in _as_group_list(param_groups)]
    names: list[str] = []
    for g in groups:
        for p in g["params"]:
            if is_moe_param(p) and p.group_name not in names:
                names.append(p.group_name)
    moe_groups: list[dict[str, Any]] = []
    for g in groups:
        for name in names:
            params = [p for p in g["params"] if is_moe_param(p) and p.group_name == name]
            moe_groups += [{**g, "name": name, "moe": True, "params": run} for run in _chunks(params, max_group_size)
                           if run]
        g["params"] = [p for p in g["params"] if not is_moe_param(p)]
    return groups + moe_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """True for a group made by `split_params_into_different_moe_groups_for_optimizer` ("moe": True)."""
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list) -> list[dict[str, Any]]:
    """Parameters or parameter groups -> groups with the expert parameters split out (what DeepSpeed's
    engine does to `model_parameters`): a list of tensors becomes one group named "dense-params" and
    is split; groups are split unless one of them already has a "moe" key."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of Tensors "
                            f"or dicts, but got {type(p)}")
    if not model_parameters:
        return model_parameters
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
