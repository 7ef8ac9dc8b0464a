"""DeepSpeed's `deepspeed.moe.sharded_moe` API: the gating functions, `TopKGate` and `MOELayer`.

`top1gating`, `top2gating` and `topkgating` keep DeepSpeed 0.19.8's signatures and return values and give
its numbers bit for bit (same logits and seed -> same l_aux, combine weights, dispatch mask, expert
counts; see `routing.py` for the rules and the papers). `MOELayer` runs GShard's layer (Lepikhin et al.
2020, Algorithm 2) in five steps, each a function of its own:

    dispatch_tokens -> exchange_with_experts -> experts -> exchange_with_experts -> combine_tokens

The two exchanges are the expert-parallel all-to-alls (`all_to_all_single` over the expert process group,
whose backward is the same all-to-all); with one expert-parallel rank they are the identity. By default
(`MOELayer.packed`) the layer skips the padded [E, C, M] buffers and runs `dropless.dropless_experts` on the
kept routes, packed per expert, with a variable-size all-to-all: the same routing and dropped tokens
(DeepSpeed's, capacity C), but no padding row computed or exchanged (with capacity factor 1.25 up to a
quarter of the expert rows, and with drop_tokens=False every expert's padding to the largest load);
`MOELayer.packed = False` runs DeepSpeed's padded layout, bit for bit.

Shapes: S tokens, M model (hidden) size, E experts, k routes per token, C capacity.
"""
from __future__ import annotations

import logging
import time
import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .dropless import AllToAll, dropless_experts
from .experts import check_expert_output
from .routing import (Routes, expert_capacity, gumbel_rsample, multiplicative_jitter, route_top1, route_top2,
                      route_topk)

__all__ = ["top1gating", "top2gating", "topkgating", "TopKGate", "MOELayer", "gumbel_rsample",
           "multiplicative_jitter", "expert_capacity", "dispatch_tokens", "exchange_with_experts", "combine_tokens"]

_log = logging.getLogger(__name__)
NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
NO_EP_GROUP = ("has ep_size={ep_size} but no expert-parallel process group yet: build the engine with "
               "zerospeed.initialize(model=...), which gives every MoE layer the mesh's \"expert\" group, or call "
               "moe.set_deepspeed_parallelism() after torch.distributed.init_process_group")


def _output(routes: Routes, sparse_routes: bool):
    return routes.sparse() if sparse_routes else routes.dense()


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: dist.ProcessGroup | None = None, sparse_routes: bool = False, use_tutel: bool = False):
    """Top-1 gating of logits [S, E] fp32 (Switch Transformer §2.2; rules in `routing.route_top1`).

    Returns (l_aux [] fp32, combine_weights [S, E, C] fp32, dispatch_mask [S, E, C] bool, exp_counts [E]
    int64), or with sparse_routes DeepSpeed's 7-tuple (see `Routes.sparse`). used_token: [S] 0/1 flags,
    unused tokens are routed nowhere. ep_group: with drop_tokens=False and more than one rank, the capacity
    is the largest load over the group (an all-reduce MAX). use_tutel only selects DeepSpeed's Tutel
    kernel for the same cumulative sum: accepted, same numbers. DeepSpeed asserts S >= min_capacity here;
    we do not (the routing is well defined: a batch smaller than min_capacity drops nothing).
    """
    del use_tutel
    routes = route_top1(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens, use_rts,
                        ep_group)
    return _output(routes, sparse_routes)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: dist.ProcessGroup | None = None, top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False, *, used_token: Tensor | None = None):
    """Top-2 gating of logits [S, E] fp32 (GShard Algorithm 1; rules in `routing.route_top2`); returns as
    `top1gating`. Unlike DeepSpeed's, it leaves `logits` unchanged (DeepSpeed adds the 2nd-expert Gumbel
    noise to the caller's tensor in place) and takes a keyword-only used_token (DeepSpeed's has none)."""
    routes = route_top2(logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling,
                        used_token)
    return _output(routes, sparse_routes)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: dist.ProcessGroup | None = None, drop_policy: str = "probs", sparse_routes: bool = False,
               *, used_token: Tensor | None = None):
    """Top-k gating of logits [S, E] fp32 for any 1 <= k <= E (rules in `routing.route_topk`); returns
    as `top1gating`. drop_policy: "probs" (keep each expert's most probable tokens) or "position"."""
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"topkgating: k={k} routes per token with {logits.shape[1]} experts; use 1 <= k <= E")
    routes = route_topk(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy, used_token)
    return _output(routes, sparse_routes)


def _check_gate_args(model_dim: int, num_experts: int, k: int, capacity_factor: float, eval_capacity_factor: float,
                     min_capacity: int, noisy_gate_policy: str | None) -> None:
    """ValueError naming the bad value and the fix."""
    if model_dim < 1 or num_experts < 1:
        raise ValueError(f"TopKGate: model_dim={model_dim} and num_experts={num_experts} must both be >= 1")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k} routes per token but there are {num_experts} experts: use 1 <= k <= num_experts "
                         "(k=1 is Switch routing, k=2 GShard's)")
    if capacity_factor <= 0 or eval_capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} and eval_capacity_factor={eval_capacity_factor} must "
                         "be > 0 (1.0 gives each expert S*k/E slots; use drop_tokens=False for no limit)")
    if min_capacity < 0:
        raise ValueError(f"min_capacity={min_capacity} must be >= 0")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}: use None, 'Jitter' (multiply the router "
                         "input by uniform noise in [0.99, 1.01)) or 'RSample' (Gumbel noise on the top-1 logits)")


class TopKGate(nn.Module):
    """The router: a bias-free fp32 linear map [M] -> [E] logits, then top-k gating (GShard §2.2).

    DeepSpeed's defaults and semantics: capacity_factor in training, eval_capacity_factor in eval mode;
    noisy_gate_policy "Jitter" multiplies the router input by uniform noise (training only, every k),
    "RSample" adds Gumbel noise to the top-1 choice (training only, k=1 only: with k >= 2 it has no effect,
    as in DeepSpeed, and a warning says so); use_rts applies to k=1; top2_2nd_expert_sampling to k=2;
    k >= 3 uses `topkgating`. The logits are computed in fp32 whatever the input dtype (`wg` is created
    fp32; under `model.half()` its weight is upcast for the product). used_token is honoured for every k
    (DeepSpeed ignores it for k >= 2).
    """

    wg: nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: dist.ProcessGroup | None = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        _check_gate_args(model_dim, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                         noisy_gate_policy)
        if noisy_gate_policy == "RSample" and k != 1:
            other = "top2_2nd_expert_sampling (on by default) or 'Jitter'" if k == 2 else "'Jitter'"
            warnings.warn(f"noisy_gate_policy='RSample' only affects k=1 gating (as in DeepSpeed); with k={k} it has "
                          f"no effect: use {other}", stacklevel=3)
        self.wg = nn.Linear(model_dim, num_experts, bias=False, dtype=torch.float32)
        self.ep_group = ep_group
        self.sync_capacity = True  # the drop_tokens=False capacity is the group maximum (MOELayer: packed clears it)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0  # ms of the last forward, measured when wall_clock_breakdown is set

    def _set_ep_group(self, ep_group: dist.ProcessGroup | None) -> None:
        if self.ep_group is not None:
            raise RuntimeError("TopKGate: the expert-parallel group is already set; it can be set once")
        self.ep_group = ep_group

    def route(self, input: Tensor, used_token: Tensor | None = None) -> Routes:
        """Route tokens input [S, M] (any float dtype): the `Routes` of this gate's rule."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        logits = nn.functional.linear(x, weight=self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        # drop_tokens=False sizes the padded buffers by the largest load over the group (an all-reduce MAX);
        # MOELayer's dropless path needs no common capacity and clears sync_capacity (local largest load)
        group = self.ep_group if self.sync_capacity else None
        if self.k == 1:
            noisy = self.noisy_gate_policy if self.training else None
            return route_top1(logits, factor, self.min_capacity, used_token, noisy, self.drop_tokens, self.use_rts,
                              group)
        if self.k == 2:
            return route_top2(logits, factor, self.min_capacity, self.drop_tokens, group,
                              self.top2_2nd_expert_sampling, used_token)
        return route_topk(logits, self.k, factor, self.min_capacity, self.drop_tokens, group, used_token=used_token)

    def forward(self, input: Tensor, used_token: Tensor | None = None, sparse_routes: bool = False,
                use_tutel: bool = False):
        """input [S, M] -> DeepSpeed's gating output (see `top1gating`); use_tutel is accepted (same numbers)."""
        del use_tutel
        started = time.perf_counter() if self.wall_clock_breakdown else 0.0
        out = _output(self.route(input, used_token), sparse_routes)
        if self.wall_clock_breakdown:
            self.gate_time = (time.perf_counter() - started) * 1e3
        return out


def _flat_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Routes (indices [k, S], -1 = dropped; locations [k, S]) -> [k, S] int64 row of each route in the
    flat [E*C] expert buffer; a dropped route points at row E*C, one past the end."""
    rows = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, rows, torch.full_like(rows, num_experts * capacity))


def dispatch_tokens(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Tokens [S, M] -> expert buffer [E, C, M]: row slots[r, s] gets token s; empty slots are zero.

    Each slot holds at most one token, so the buffer is a gather through the inverse map (slot -> token,
    S for an empty slot, which reads an appended zero row); its gradient sums a token's routes.
    """
    num_tokens, model_dim = tokens.shape
    rows = num_experts * capacity
    source = torch.full((rows + 1,), num_tokens, dtype=torch.long, device=tokens.device)
    token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(slots)
    source.index_put_((slots.reshape(-1),), token_ids.reshape(-1))  # dropped routes all land on row E*C
    padded = torch.cat([tokens, tokens.new_zeros(1, model_dim)])
    return padded.index_select(0, source[:rows]).view(num_experts, capacity, model_dim)


def exchange_with_experts(buffer: Tensor, ep_group: dist.ProcessGroup | None, ep_size: int, logger=None) -> Tensor:
    """The expert-parallel all-to-all of an expert buffer (GShard Algorithm 2). Dispatch: [E, C, M] in global
    expert order, rank j receiving the slots of its E/ep_size experts from every rank, which arrive as
    [ep_size (source rank), E/ep_size, C, M] flattened; combine: the same exchange of the experts' outputs
    sends each source rank its slots back, in global expert order. With ep_size 1 the identity. Differentiable
    (its backward is the same all-to-all). logger: a `CommsLogger` counting the "all_to_all" elements."""
    if ep_size == 1:
        return buffer.contiguous()
    return AllToAll.apply(ep_group, logger, None, None, buffer)


def combine_tokens(expert_output: Tensor, slots: Tensor, weights: Tensor, num_tokens: int) -> Tensor:
    """Expert outputs [E*C, M] -> tokens [S, M]: sum over a token's k routes of weight x its slot's output.

    weights [k, S] fp32: the products and the sum over routes are fp32, then cast to the output dtype.
    A dropped route (slot E*C) reads an appended zero row.
    """
    model_dim = expert_output.shape[-1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, model_dim)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, model_dim)
    return (routed * weights.unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)


class MOELayer(nn.Module):
    """GShard's MoE layer (Lepikhin et al. 2020, Algorithm 2): gate, dispatch to expert buffers, experts,
    combine. forward(hidden_states [..., M], used_token=None) -> [..., M]; sets `l_aux` and `exp_counts`.

    With ep_size > 1 the layer holds num_local_experts = E / ep_size experts and needs its expert process group
    (`_set_ep_group`, done by `zerospeed.initialize`; a forward without it raises RuntimeError). use_tutel=True
    is accepted and
    changes nothing: Tutel is a GPU kernel library for the same dispatch (DeepSpeed also proceeds without
    it when it is not installed); zerospeed has no Tutel path.
    """

    def __init__(self, gate: nn.Module, experts: nn.Module, ep_group_name: str | None, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        if use_tutel:
            _log.info("use_tutel=True: zerospeed has no Tutel kernels; the standard dispatch gives the same numbers")
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0  # ms, with wall_clock_breakdown
        self.logger = None  # a CommsLogger counting the all-to-alls (set by zerospeed.initialize)
        # the experts run on exactly the kept routes (`dropless.py`), for drop_tokens True and False; False:
        # DeepSpeed's padded [E, C, M] layout (C slots per expert, the largest load for drop_tokens=False)
        self.packed = True
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None

    @property
    def dropless(self) -> bool:
        """The name of `packed` before it covered capacity routing too (kept for scripts that set it)."""
        return self.packed

    @dropless.setter
    def dropless(self, value: bool) -> None:
        self.packed = bool(value)

    def _set_ep_group(self, ep_group: dist.ProcessGroup | None) -> None:
        """Use `ep_group` (ep_size ranks, each holding num_local_experts experts) for the all-to-alls. Raises
        ValueError when its size is not ep_size."""
        if ep_group is not None and dist.get_world_size(ep_group) != self.ep_size:
            raise ValueError(f"MoE layer with ep_size={self.ep_size} given an expert-parallel group of "
                             f"{dist.get_world_size(ep_group)} ranks: the group must have ep_size ranks")
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError("MoE layer " + NO_EP_GROUP.format(ep_size=self.ep_size))
        started = time.perf_counter() if self.wall_clock_breakdown else 0.0
        model_dim = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, model_dim)
        self.gate.sync_capacity = not self.packed
        (self.l_aux, capacity, num_experts, indices, locations, weights,
         self.exp_counts) = self.gate(tokens, used_token, True, self.use_tutel)
        if self.packed:
            out = dropless_experts(tokens, indices, weights, self.experts.deepspeed_experts, num_experts,
                                   self.ep_group, self.ep_size, self.logger, check_expert_output)
            if self.wall_clock_breakdown:
                self.time_moe = (time.perf_counter() - started) * 1e3
            return out.reshape(hidden_states.shape)
        capacity = int(capacity)
        slots = _flat_slots(indices, locations, num_experts, capacity)
        buffer = dispatch_tokens(tokens, slots, num_experts, capacity)
        buffer = exchange_with_experts(buffer, self.ep_group, self.ep_size, self.logger)
        buffer = buffer.reshape(self.ep_size, self.num_local_experts, -1, model_dim)
        expert_output = self.experts(buffer).reshape(self.ep_size * self.num_local_experts, -1, model_dim)
        expert_output = exchange_with_experts(expert_output, self.ep_group, self.ep_size, self.logger)
        out = combine_tokens(expert_output.reshape(num_experts * capacity, model_dim), slots, weights, len(tokens))
        if self.wall_clock_breakdown:
            self.time_moe = (time.perf_counter() - started) * 1e3
        return out.reshape(hidden_states.shape)
