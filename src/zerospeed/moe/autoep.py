"""AutoEP: expert parallelism for an unmodified Hugging Face MoE model (DeepSpeed 0.19.8's `expert_parallel`).

transformers (5.x) stores the experts of an MoE block (Mixtral's `MixtralSparseMoeBlock`, Qwen3-MoE's,
DeepSeek-V2/V3's `...MoE`, ...) as one module of fused 3-D weights, `gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I], called by the block as `experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`
after the block's own router has chosen the k experts of each token (its softmax or sigmoid scores,
normalisation, scaling, group-limited routing, bias) and before it adds any shared experts. AutoEP replaces
only that experts module with `ExpertParallelExperts`: this rank's E / ep experts (rows [r E/ep, (r+1) E/ep) of
both weights, r = the rank in its "expert" group), run dropless on exactly the tokens routed to them, the
tokens moved by all-to-all over the "expert" group (`dropless.dropless_experts`: counts exchanged first, a
variable-size all-to-all, no capacity, no padding; MegaBlocks, Gale et al. 2023 §3). The router, the shared
experts and the router auxiliary loss are the model's own modules, untouched, so routing and outputs equal
the unmodified model's (DeepSpeed instead rebuilds the router from the preset's rules).

Supported layout: transformers' `use_experts_implementation` defaults (concatenated [gate; up], not
transposed, no bias, gated, no post-expert norm); any other is refused by name.
"""
from __future__ import annotations

import functools
import re

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .dropless import dropless_experts

__all__ = ["ExpertParallelExperts", "MoEBlock", "find_moe_blocks", "fused_experts_problem"]

_LAYOUT = (("has_bias", False), ("is_transposed", False), ("is_concatenated", True), ("has_gate", True),
           ("has_post_expert_norm", False))


def fused_experts_problem(module: nn.Module) -> str | None:
    """Why `module` is not a supported fused-experts module (None if it is)."""
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.dim() == 3 and down.dim() == 3):
        return "no 3-D gate_up_proj / down_proj weights"
    if not isinstance(getattr(module, "num_experts", None), int) or up.shape[0] != module.num_experts:
        return "no num_experts attribute matching the weights"
    if up.shape[0] != down.shape[0] or up.shape[1] != 2 * down.shape[2] or up.shape[2] != down.shape[1]:
        return f"weights of shapes {tuple(up.shape)} and {tuple(down.shape)} are not [E, 2I, H] and [E, H, I]"
    bad = [f"{k}={getattr(module, k)}" for k, want in _LAYOUT if getattr(module, k, want) != want]
    if bad:
        return f"an expert layout AutoEP does not implement yet ({', '.join(bad)})"
    if not hasattr(module, "act_fn"):
        return "no act_fn"
    return None


class MoEBlock:
    """An MoE block found in a model: `name` (module path), its `experts` child (named `experts_name`) and the
    router child's name (kept as it is)."""

    def __init__(self, name: str, block: nn.Module, experts_name: str, router_name: str):
        self.name, self.block, self.experts_name, self.router_name = name, block, experts_name, router_name

    @property
    def experts(self) -> nn.Module:
        return getattr(self.block, self.experts_name)

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts


def find_moe_blocks(model: nn.Module, *, moe_layer_pattern: str | None = None, expert_pattern: str | None = None,
                    router_pattern: str | None = None) -> list[MoEBlock]:
    """The model's MoE blocks: modules whose `expert_pattern` child (default "experts") is a supported fused-
    experts module and that have a `router_pattern` child (default "gate"); with `moe_layer_pattern`, only
    modules whose name it fully matches. Pure (no process group). Raises ValueError when a block selected by
    name has unsupported experts (naming why) or no router child."""
    experts_name, router_name = expert_pattern or "experts", router_pattern or "gate"
    pattern = re.compile(moe_layer_pattern) if moe_layer_pattern else None
    out = []
    for name, module in model.named_modules():
        child = getattr(module, experts_name, None)
        if not isinstance(child, nn.Module) or isinstance(child, ExpertParallelExperts):
            continue
        if pattern is not None and not pattern.fullmatch(name):
            continue
        problem = fused_experts_problem(child)
        if problem is not None:
            if pattern is not None:
                raise ValueError(f"expert_parallel: {name}.{experts_name} ({type(child).__name__}) has {problem}")
            continue
        if not isinstance(getattr(module, router_name, None), nn.Module):
            raise ValueError(f"expert_parallel: MoE block {name} ({type(module).__name__}) has no router child "
                             f"{router_name!r}; set expert_parallel.router_pattern to its name")
        out.append(MoEBlock(name, module, experts_name, router_name))
    return out


class ExpertParallelExperts(nn.Module):
    """This rank's experts of one MoE block: `gate_up_proj` [L, 2I, H], `down_proj` [L, H, I] (L = E / ep_size,
    global experts ep_rank x L + i), with the source module's `act_fn` and its `forward(hidden_states [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H]` (the sum over a token's k routes of weight x expert
    output). Collective over the "expert" group (`_set_ep_group`) in forward and backward. Built from the full
    module (`from_full`), whose weights every rank holds equal.

    Attributes shared with `sharded_moe.MOELayer` for the engine (`runtime/moe_setup.py`): `ep_size`,
    `num_local_experts`, `ep_group`, `logger`, `_set_ep_group`, `expert_parameters()`.
    """

    def __init__(self, gate_up_proj: Tensor, down_proj: Tensor, act_fn, num_experts: int, ep_size: int,
                 ep_rank: int):
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by autoep_size={ep_size}")
        self.num_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        self.num_local_experts = num_experts // ep_size
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.act_fn = act_fn
        self.ep_group: dist.ProcessGroup | None = None
        self.logger = None

    @classmethod
    def from_full(cls, full: nn.Module, ep_size: int, ep_rank: int) -> ExpertParallelExperts:
        """Rows [ep_rank L, (ep_rank + 1) L) of `full`'s weights, copied (the full tensors can be freed)."""
        num_local = full.num_experts // ep_size
        lo, hi = ep_rank * num_local, (ep_rank + 1) * num_local
        with torch.no_grad():
            up = full.gate_up_proj.detach()[lo:hi].clone()
            down = full.down_proj.detach()[lo:hi].clone()
        out = cls(up, down, full.act_fn, full.num_experts, ep_size, ep_rank)
        out.gate_up_proj.requires_grad_(full.gate_up_proj.requires_grad)
        out.down_proj.requires_grad_(full.down_proj.requires_grad)
        return out

    def _set_ep_group(self, group: dist.ProcessGroup | None) -> None:
        self.ep_group = group

    def expert_parameters(self):
        return self.parameters()

    def _expert(self, gate_up: Tensor, down: Tensor, x: Tensor) -> Tensor:
        gate, up = nn.functional.linear(x, gate_up).chunk(2, dim=-1)
        return nn.functional.linear(self.act_fn(gate) * up, down)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError("ExpertParallelExperts has no expert-parallel group: build it through "
                               "zerospeed.initialize with expert_parallel.enabled")
        index = top_k_index.t()
        index = torch.where(index < self.num_experts, index, -1)  # the "no expert" index E of transformers' EP
        # one unbind per weight, not an index per expert: each index's backward would zero-fill and add a whole
        # [L, ...] gradient (L fills of the full tensor per step); unbind's backward stacks the L slices once
        experts = [functools.partial(self._expert, gate_up, down)
                   for gate_up, down in zip(self.gate_up_proj.unbind(0), self.down_proj.unbind(0))]
        return dropless_experts(hidden_states, index, top_k_weights.t(), experts, self.num_experts, self.ep_group,
                                self.ep_size, self.logger)

    def extra_repr(self) -> str:
        return (f"experts {self.ep_rank * self.num_local_experts}..{(self.ep_rank + 1) * self.num_local_experts - 1}"
                f" of {self.num_experts}, ep_size={self.ep_size}")
