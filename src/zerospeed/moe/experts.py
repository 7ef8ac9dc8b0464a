"""DeepSpeed's `deepspeed.moe.experts.Experts`: the experts of one rank, deep copies of one module."""
from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["Experts"]


class Experts(nn.Module):
    """`num_local_experts` independent deep copies of `expert` (a module mapping [..., M] -> [..., M]).

    Their parameters are marked as DeepSpeed marks them, `param.allreduce = False` and
    `param.group_name = expert_group_name` (e.g. "ep_size_1"), because DeepSpeed's user-facing helpers
    (`is_moe_param`, `split_params_into_different_moe_groups_for_optimizer`) and user code read these two
    attributes. They are the only attributes zerospeed sets on a parameter (DESIGN rule 3 otherwise keeps
    per-parameter state off `nn.Parameter`): the price of a drop-in API.

    forward(inputs [ep_size, num_local_experts, C, M]) -> [ep_size, num_local_experts, C, M]: local expert
    i runs on inputs[:, i]. An expert returning a tuple (Megatron's (output, bias)) contributes its first
    element; one whose output shape differs from its input's is an error naming both shapes.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for param in self.deepspeed_experts.parameters():
            param.allreduce = False
            param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dim() < 2 or inputs.shape[1] != self.num_local_experts:
            raise ValueError(f"Experts: input of shape {tuple(inputs.shape)}; expected [ep_size, "
                             f"num_local_experts={self.num_local_experts}, capacity, hidden]")
        outputs = []
        for i, (chunk, expert) in enumerate(zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts)):
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]
            check_expert_output(out, chunk, f"expert {i} ({type(expert).__name__})")
            outputs.append(out)
        return torch.cat(outputs, dim=1)


def check_expert_output(out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
    """ValueError unless `out` (what a module returned for `inp`) has `inp`'s shape."""
    if not isinstance(out, torch.Tensor) or out.shape != inp.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"MoE {what} returned shape {got} for an input of shape {tuple(inp.shape)}: an expert "
                         f"must map [..., hidden_size={inp.shape[-1]}] to the same shape, e.g. "
                         "nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))")
