"""DeepSpeed's `deepspeed.moe.layer.MoE`: a mixture-of-experts layer to put in place of a dense MLP.

    from zerospeed.moe.layer import MoE
    self.moe = MoE(hidden_size=1024, expert=MLP(1024), num_experts=8, k=2)
    ...
    out, l_aux, exp_counts = self.moe(x)      # x [..., 1024]; add coeff * l_aux to the loss

Same names, defaults, state-dict keys (`deepspeed_moe.gate.wg.weight`,
`deepspeed_moe.experts.deepspeed_experts.<i>.*`, `mlp.*`, `coefficient.*`) and construction order (so a
seeded build draws the same initial weights) as DeepSpeed 0.19.8.
"""
from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .experts import Experts, check_expert_output
from .sharded_moe import MOELayer, TopKGate, _check_gate_args

__all__ = ["MoE"]


class MoE(nn.Module):
    """A mixture-of-experts layer: a top-k router over `num_experts` deep copies of `expert`.

    hidden_size: M, the input and output width. expert: any module mapping [..., M] -> [..., M].
    k: experts per token (1: Switch, 2: GShard, more: DeepSpeed's top-k). capacity_factor /
    eval_capacity_factor: expert capacity in training / eval, C = ceil(k x S x factor / E) tokens
    (S tokens in the batch) but at least min_capacity; tokens over capacity are dropped (their output is
    0, or the residual branch's with use_residual) unless drop_tokens=False. use_residual: PR-MoE's
    residual MoE (Rajbhandari et al. 2022, §4.1): `expert` itself also runs densely on every token and a
    learned 2-way softmax `coefficient` mixes the two outputs. noisy_gate_policy, use_rts,
    top2_2nd_expert_sampling: see `TopKGate`.

    ep_size: expert parallelism (GShard, Lepikhin et al. 2020 §2.2): each of ep_size consecutive
    data-parallel ranks holds num_experts / ep_size experts (global ids ep_rank x num_local_experts + i)
    and tokens reach them by all-to-all over the mesh's "expert" group, which `zerospeed.initialize` builds
    and hands to the layer (`set_deepspeed_parallelism()` does it outside an engine); ep_size 1: every
    expert on every rank (to the engine, an ordinary module). Accepted because they change nothing here:
    use_tutel (Tutel is a GPU kernel for the same dispatch) and enable_expert_tensor_parallelism (it only
    chooses how the expert process groups are built when a tensor-parallel mpu exists).

    forward(hidden_states [..., M], used_token=None) -> (output [..., M], l_aux [] fp32, exp_counts [E]
    int64). used_token: one 0/1 flag per token (shape hidden_states.shape[:-1] or flat); unused tokens
    are routed nowhere.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        _check_layer_args(hidden_size, num_experts, ep_size)
        _check_gate_args(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                         noisy_gate_policy)
        self.hidden_size = hidden_size
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Give the layer its expert-parallel group outside `zerospeed.initialize` (which does it itself):
        groups of ep_size consecutive ranks of the world (`torch.distributed.new_subgroups`; DeepSpeed's
        default layout, and the mesh's "expert" groups without model parallelism). Collective over the world when ep_size > 1 (it creates process groups);
        nothing to do at ep_size 1. use_data_before_expert_parallel_=True (DeepSpeed's strided expert
        groups) raises NotImplementedError."""
        if use_data_before_expert_parallel_:
            raise NotImplementedError("use_data_before_expert_parallel_=True (strided expert groups) is not "
                                      "supported: zerospeed's expert groups are consecutive data-parallel ranks")
        if self.ep_size > 1:  # consecutive ranks, as the mesh's "expert" groups without model parallelism
            self.set_ep_group(dist.new_subgroups(group_size=self.ep_size)[0])

    def set_ep_group(self, group) -> None:
        """Use `group` (ep_size ranks) for this layer's all-to-alls and, with drop_tokens=False, its capacity."""
        self.deepspeed_moe._set_ep_group(group)

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: hidden_states of shape {tuple(hidden_states.shape)}, but hidden_size="
                             f"{self.hidden_size}: the last dimension must be hidden_size")
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output = self._mix_residual(output, hidden_states)
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts

    def _mix_residual(self, moe_output: Tensor, hidden_states: Tensor) -> Tensor:
        """PR-MoE: softmax(coefficient(x)) [..., 2] weighs the MoE output and the dense expert's."""
        dense = self.mlp(hidden_states)
        if isinstance(dense, tuple):
            dense = dense[0]
        check_expert_output(dense, hidden_states, "residual mlp (use_residual=True)")
        coef = F.softmax(self.coefficient(hidden_states), dim=-1)
        return moe_output * coef[..., 0:1] + dense * coef[..., 1:]


def _check_layer_args(hidden_size: int, num_experts: int, ep_size: int) -> None:
    """ValueError / NotImplementedError naming the bad value and the fix."""
    if hidden_size < 1 or num_experts < 1 or ep_size < 1:
        raise ValueError(f"MoE: hidden_size={hidden_size}, num_experts={num_experts} and ep_size={ep_size} must "
                         "all be >= 1")
    if num_experts % ep_size:
        lower = num_experts // ep_size * ep_size
        hint = f"{lower} or {lower + ep_size}" if lower else f"{ep_size}"
        raise ValueError(f"MoE: num_experts={num_experts} is not divisible by ep_size={ep_size} (each expert-"
                         f"parallel rank holds num_experts / ep_size experts): use num_experts={hint}, or an "
                         "ep_size that divides num_experts")

