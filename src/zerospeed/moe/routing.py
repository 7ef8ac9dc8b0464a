"""Top-k token routing for mixture-of-experts layers: which slot of which expert each token goes to.

The algorithms:

* expert capacity, position-based token dropping, top-2 gating and the auxiliary load-balancing loss:
  GShard, Lepikhin et al. 2020 (arXiv 2006.16668), §2.2 and Algorithm 1;
* top-1 ("switch") routing and the loss `l_aux = E * sum_e f_e * P_e` (f_e: fraction of tokens sent to
  expert e, P_e: mean router probability of e): Switch Transformer, Fedus et al. 2021, §2.2, eq. 4-6;
* DeepSpeed-MoE's additions (Rajbhandari et al. 2022): random token selection (RTS: a capacity-limited
  expert keeps a random subset of its tokens instead of the first ones), Gumbel noise ("RSample") for the
  top-1 choice, sampling of the 2nd expert in top-2, and "dropless" routing (capacity = largest load).

Every rule reproduces DeepSpeed 0.19.8's `deepspeed.moe.sharded_moe` bit for bit: where float rounding or
tie-breaking depends on the exact torch op (the capacity's float32 arithmetic, `torch.topk` among equal
values, sums over the expert dimension), the same op is used; random numbers are drawn from torch's
default generator with the same calls in the same order, so a seeded run routes identically.

Shapes: S tokens, E experts, k routes per token, C capacity (token slots per expert).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..comm.ops import all_reduce

__all__ = ["Routes", "expert_capacity", "gumbel_rsample", "multiplicative_jitter", "route_top1", "route_top2",
           "route_topk"]


@dataclass
class Routes:
    """The routing of S tokens to E experts with capacity C, route r of token s being (experts[r, s],
    slots[r, s]) with combine weight weights[r, s]. Route 0 is each token's first choice.

    l_aux:      [] fp32, the load-balancing loss (differentiable w.r.t. the router logits).
    capacity:   C, token slots per expert.
    num_experts: E.
    experts:    [k, S] int64, the expert of each route (also for dropped routes).
    slots:      [k, S] int64, the route's position in its expert's buffer, in [0, C); 0 where not kept.
    kept:       [k, S] bool, False where the route was dropped (over capacity, or an unused token).
    weights:    [k, S] fp32, the combine weight (differentiable), 0 where not kept.
    exp_counts: [E] int64, tokens routed to each expert before capacity dropping.
    """

    l_aux: Tensor
    capacity: int
    num_experts: int
    experts: Tensor
    slots: Tensor
    kept: Tensor
    weights: Tensor
    exp_counts: Tensor

    def dense(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """DeepSpeed's dense gating output (l_aux, combine_weights [S, E, C] fp32, dispatch_mask [S, E, C]
        bool, exp_counts [E]): combine_weights[s, e, c] is the weight of token s in slot c of expert e."""
        k, num_tokens = self.experts.shape
        combine = self.weights.new_zeros(num_tokens, self.num_experts, self.capacity)
        tokens = torch.arange(num_tokens, device=self.experts.device).expand(k, num_tokens)
        kept = self.kept
        combine = combine.index_put((tokens[kept], self.experts[kept], self.slots[kept]), self.weights[kept])
        return self.l_aux, combine, combine.bool(), self.exp_counts

    def sparse(self) -> tuple[Tensor, Tensor, int, Tensor, Tensor, Tensor, Tensor]:
        """DeepSpeed's `sparse_routes=True` output (l_aux, capacity [] int64, E, indices [k, S] int32 with
        -1 for a dropped route, locations [k, S] int32, gates [k, S] fp32, exp_counts [E])."""
        indices = torch.where(self.kept, self.experts, torch.full_like(self.experts, -1))
        capacity = torch.tensor(self.capacity, dtype=torch.int64, device=self.experts.device)
        return (self.l_aux, capacity, self.num_experts, indices.to(torch.int32), self.slots.to(torch.int32),
                self.weights, self.exp_counts)


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Token slots per expert: ceil(S / E x capacity_factor), at least min_capacity (GShard §2.2).

    Callers pass k x capacity_factor for top-k routing. The product is taken as DeepSpeed takes it, in
    float32 (`float32(S / E) * float32(factor)`), so it can round up past an exact integer: S=25, E=2,
    factor 1.2 gives 16, where exact arithmetic gives 15.
    """
    factor = torch.tensor(capacity_factor)
    per_expert = torch.ceil((num_tokens / num_experts) * factor).to(torch.int64)
    return int(torch.maximum(per_expert, torch.tensor(min_capacity).to(torch.int64)))


def _dropless_capacity(exp_counts: Tensor, ep_group: dist.ProcessGroup | None) -> int:
    """Capacity when no token may be dropped: the largest expert load [tokens], the maximum over the
    expert-parallel group when it has more than one rank (so every rank sizes its buffers alike)."""
    largest = torch.max(exp_counts)
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        all_reduce(largest, group=ep_group, op=dist.ReduceOp.MAX)
    return int(largest)


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel noise [shape] fp32: -log(-log(u)) with u uniform on [tiny, 1 - eps).

    The same numbers as `torch.distributions.Gumbel(0., 1.).rsample(shape)` (one `torch.rand` call), at a
    fraction of its construction cost.
    """
    finfo = torch.finfo(torch.float32)
    low = torch.tensor(finfo.tiny, device=device)
    high = torch.tensor(1 - finfo.eps, device=device)
    u = low + torch.rand(shape, dtype=torch.float32, device=device) * (high - low)
    return -torch.log(-torch.log(u))


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """x times noise uniform on [1 - epsilon, 1 + epsilon) (Switch Transformer's router input jitter,
    Fedus et al. 2021 §2.4), drawn as `torch.distributions.Uniform(1 - eps, 1 + eps).rsample(x.shape)`."""
    if epsilon == 0:
        return x
    low = torch.tensor(1.0 - epsilon, device=device)
    high = torch.tensor(1.0 + epsilon, device=device)
    return x * (low + torch.rand(x.shape, dtype=low.dtype, device=device) * (high - low))


def _used_column(used_token: Tensor, num_tokens: int, like: Tensor) -> Tensor:
    """used_token (any shape with S elements, nonzero = used) as a [S, 1] column of like's dtype."""
    if used_token.numel() != num_tokens:
        raise ValueError(f"used_token has {used_token.numel()} elements (shape {tuple(used_token.shape)}) but "
                         f"there are {num_tokens} tokens; pass one 0/1 flag per token (hidden_states.shape[:-1])")
    return (used_token.reshape(-1, 1) != 0).to(like.dtype)


def _slots_of(mask: Tensor) -> Tensor:
    """[S, E] 0/1 mask -> [S, E] int64 position of each token among the tokens of its expert (in token
    order), -1 before an expert's first token; the slot of a kept route (GShard's cumsum - 1)."""
    return torch.cumsum(mask, dim=0) - 1


def route_top1(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: dist.ProcessGroup | None = None) -> Routes:
    """Top-1 routing of logits [S, E] (Switch Transformer §2.2).

    Each token goes to the expert of largest softmax probability (of largest logit + Gumbel noise with
    noisy_gate_policy "RSample"); its combine weight is that probability (not renormalised). An expert
    keeps C = expert_capacity(S, E, capacity_factor, min_capacity) tokens: with use_rts the C of largest
    uniform random priority (RTS), without it the ones `torch.topk` returns among equal 0/1 priorities
    (DeepSpeed's rule: which of the tied tokens that is is torch's choice, not "the first C").
    drop_tokens=False: C = the largest load (over ep_group), nothing is dropped. Random draws, in order:
    the Gumbel noise [S, E] (RSample), then the RTS priorities [S, E].
    """
    noisy = logits + gumbel_rsample(logits.shape, device=logits.device) if noisy_gate_policy == "RSample" else None
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = expert_capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    chosen = torch.argmax(gates if noisy is None else noisy, dim=1)
    mask = F.one_hot(chosen, num_classes=num_experts)  # [S, E] int64
    if used_token is not None:
        mask = mask * _used_column(used_token, num_tokens, mask)
    exp_counts = torch.sum(mask, dim=0).detach()
    if not drop_tokens:
        capacity = min(_dropless_capacity(exp_counts, ep_group), num_tokens)
    # Switch eq. 4: E * sum_e f_e P_e, rounded as DeepSpeed's top-1 rounds it
    l_aux = torch.sum(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * num_experts
    if use_rts:
        priority = mask * torch.rand(mask.shape, dtype=torch.float32, device=mask.device)
    else:
        priority = mask
    keep = torch.topk(priority, k=min(capacity, num_tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    slots = torch.sum(_slots_of(mask) * mask, dim=1)
    weights = torch.sum(gates * mask, dim=1)
    return Routes(l_aux, capacity, num_experts, chosen.unsqueeze(0), slots.unsqueeze(0),
                  (mask.sum(dim=1) > 0).unsqueeze(0), weights.unsqueeze(0), exp_counts)


def route_top2(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: dist.ProcessGroup | None = None, top2_2nd_expert_sampling: bool = True,
               used_token: Tensor | None = None) -> Routes:
    """Top-2 routing of logits [S, E] (GShard Algorithm 1).

    First choice: the largest softmax probability. Second: the largest logit among the other experts,
    after adding Gumbel noise [S, E] when top2_2nd_expert_sampling (the Gumbel-max trick samples the 2nd
    expert from the softmax; DeepSpeed does this in eval mode too, and so do we). Slots: every first
    choice, in token order, before every second choice (GShard), so with C = expert_capacity(S, E,
    2 x capacity_factor, min_capacity) the routes at slot >= C are dropped (position-based). The two
    kept weights are renormalised to sum to 1 (a token with one kept route gets weight 1 on it).
    used_token masks tokens out of both choices (DeepSpeed's top-2 has no used_token: an extension).
    """
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    if used_token is not None:
        used = _used_column(used_token, num_tokens, mask1)
        mask1, mask2 = mask1 * used, mask2 * used
    slots1 = _slots_of(mask1)
    slots2 = _slots_of(mask2) + torch.sum(mask1, dim=0, keepdim=True)
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0)) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        capacity = expert_capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(slots1, capacity)
        mask2 = mask2 * torch.lt(slots2, capacity)
    else:
        capacity = _dropless_capacity(exp_counts, ep_group)
    weight1 = torch.sum(gates * mask1.float(), dim=1)
    weight2 = torch.sum(gates * mask2.float(), dim=1)
    denom = torch.clamp(weight1 + weight2, min=torch.finfo(weight1.dtype).eps)
    weights = torch.stack([weight1 / denom, weight2 / denom])
    slots = torch.stack([torch.sum(slots1 * mask1, dim=1), torch.sum(slots2 * mask2, dim=1)])
    kept = torch.stack([mask1.sum(dim=1) > 0, mask2.sum(dim=1) > 0])
    return Routes(l_aux, capacity, num_experts, torch.stack([first, second]), slots, kept, weights, exp_counts)


def route_topk(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: dist.ProcessGroup | None = None, drop_policy: str = "probs",
               used_token: Tensor | None = None) -> Routes:
    """Top-k routing of logits [S, E] for any k (DeepSpeed's `topkgating`; routes in descending gate order).

    Each token goes to its k most probable experts. l_aux = E^2 / k * mean_e(f_e P_e) with f_e counting
    all k choices (so it equals Switch's loss at k=1). C = expert_capacity(S, E, k x capacity_factor,
    min_capacity); over capacity, drop_policy "probs" keeps an expert's C tokens of largest gate
    probability (`torch.topk(..., sorted=False)` decides among equal ones), "position" its first C tokens.
    Kept weights are renormalised to sum to 1 per token. drop_tokens=False: C = the largest load.
    used_token masks tokens out of every choice (an extension: DeepSpeed's top-k has no used_token).
    """
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    if used_token is not None:
        mask = mask & _used_column(used_token, num_tokens, mask)
    exp_counts = torch.sum(mask, dim=0).detach()
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = expert_capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            scores = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            if used_token is not None:
                scores = scores * mask
            best = torch.topk(scores, k=min(capacity, num_tokens), dim=0, sorted=False)[1]
            mask = mask & torch.zeros_like(gates, dtype=torch.bool).scatter_(0, best, True)
            slots = _slots_of(mask)
        elif drop_policy == "position":
            slots = _slots_of(mask)
            mask = mask * torch.lt(slots, capacity)
        else:
            raise ValueError(f"drop_policy={drop_policy!r}: use 'probs' (keep the most probable tokens) or "
                             "'position' (keep the first tokens)")
    else:
        capacity = _dropless_capacity(exp_counts, ep_group)
        slots = _slots_of(mask)
    masked = gates * mask
    masked = masked / torch.clamp(torch.sum(masked, dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept = mask.gather(1, top_idx)
    return Routes(l_aux, capacity, num_experts, top_idx.t().contiguous(), (slots.gather(1, top_idx) * kept).t(),
                  kept.t(), masked.gather(1, top_idx).t().contiguous(), exp_counts)
