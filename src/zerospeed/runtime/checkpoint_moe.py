"""Experts in the topology-independent checkpoint format: each expert under its global expert id.

With expert parallelism (an MoE layer with ep_size > 1) every rank of an "expert" group holds different
experts under the same local names (`<layer>.deepspeed_experts.<i>.<param>`, i < num_local_experts). A
checkpoint names each expert by its global id, ep_rank x num_local_experts + i (DeepSpeed's numbering), so a
run saved at ep 2 resumes at ep 1, 2 or 4 (the names of an ep-1 model are the global ones) and `zerospeed
to-fp32` writes every expert. Writing: the stage-0 strategy cuts the experts' replicated state over the ranks
holding the same experts ("expert_data") and the other parameters over the data-parallel group
(`DataParallelStrategy._writer_ranges`), so over the world every element is written once. The protocol is
`checkpoint_tp.TPTranslation`'s (`full_shape`, `frags`) plus `global_name` (the checkpoint name of a local
parameter name) and `owns` (whether a checkpoint entry is for this rank's experts).

AutoEP's fused experts (`moe.autoep.ExpertParallelExperts`: `gate_up_proj` [L, 2I, H], `down_proj` [L, H, I],
rows ep_rank x L .. of the model's [E, 2I, H], [E, H, I]) keep the model's own names and are stored whole: a
rank's flat range [a, b) of its rows is range [a + o, b + o) of the full tensor, o = ep_rank x numel (dim 0
is the outermost), so the checkpoint holds the Hugging Face tensors and resumes at any ep.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from ..comm.ops import start_all_gather

__all__ = ["ExpertTranslation", "ChainedTranslation"]

_EXPERT = re.compile(r"^(?P<head>.*\.deepspeed_experts\.)(?P<index>\d+)(?P<tail>\..*)$")


class ExpertTranslation:
    """Local <-> global names of this rank's experts. module: the model; ep_rank: this rank's index in its
    "expert" group; group: that group (for `gather_full`). Raises NotImplementedError for experts with
    buffers or frozen parameters (written by their local names: they would collide across the expert group)."""

    def __init__(self, module: nn.Module, ep_rank: int, group=None):
        from ..moe.autoep import ExpertParallelExperts
        from .moe_setup import moe_layers

        self.group = group
        self.names: dict[str, str] = {}
        self.sizes: dict[str, tuple[int, int]] = {}  # layer prefix -> (ep_size, num_local_experts)
        self.ranges: dict[str, tuple[int, int]] = {}  # layer prefix "<...>.deepspeed_experts." -> global ids held
        layer_of = {id(m): n for n, m in module.named_modules()}
        for layer in moe_layers(module):
            if layer.ep_size == 1 or hasattr(layer, "expert_parameters"):  # AutoEP's fused experts: below
                continue
            local = layer.num_local_experts
            prefix = f"{layer_of[id(layer.experts)]}.deepspeed_experts."
            self.ranges[prefix] = (ep_rank * local, (ep_rank + 1) * local)
            self.sizes[prefix] = (layer.ep_size, local)
            for n, _ in layer.experts.named_buffers():
                raise NotImplementedError(f"checkpoints of experts with buffers ({prefix}{n}) under expert "
                                          "parallelism are not supported yet")
            for n, p in layer.experts.named_parameters():
                if not p.requires_grad:
                    raise NotImplementedError(f"checkpoints of frozen expert parameters ({prefix}{n}) under expert "
                                              "parallelism are not supported yet")
        self.fused: dict[str, tuple[tuple[int, ...], int]] = {}  # name -> (full shape, flat offset of this rank's rows)
        self._by_id: dict[int, tuple[int, tuple[int, ...]]] = {}  # id(fused param) -> (ep_size, full shape)
        for name, m in module.named_modules():
            if isinstance(m, ExpertParallelExperts) and m.ep_size > 1:
                for n, p in m.named_parameters():
                    if not p.requires_grad:
                        raise NotImplementedError(f"checkpoints of frozen expert parameters ({name}.{n}) under "
                                                  "expert parallelism are not supported yet")
                    self.fused[f"{name}.{n}"] = ((m.num_experts, *p.shape[1:]), ep_rank * p.numel())
                    self._by_id[id(p)] = (m.ep_size, (m.num_experts, *p.shape[1:]))
        for n, _ in module.named_parameters(remove_duplicate=False):
            m = _EXPERT.match(n)
            if m and m["head"] in self.ranges:
                self.names[n] = f"{m['head']}{self.ranges[m['head']][0] + int(m['index'])}{m['tail']}"

    def global_name(self, name: str) -> str:
        """The checkpoint name of local parameter `name` (its own name unless it is an expert's)."""
        return self.names.get(name, name)

    def full_shape(self, name: str, shape) -> tuple:
        hit = self.fused.get(name)
        return hit[0] if hit else tuple(shape)

    def frags(self, frags, *, load: bool):
        """A slot's fragments [(LogicalParam, start, end, take)] under the global expert names (fused experts:
        in the full tensor's coordinates)."""
        out = []
        for lp, start, end, take in frags:
            hit = self.fused.get(lp.name)
            if hit is not None:
                out.append((type(lp)(lp.name, lp.aliases, hit[0], lp.dtype), start + hit[1], end + hit[1], take))
            else:
                out.append((type(lp)(self.global_name(lp.name), lp.aliases, lp.shape, lp.dtype), start, end, take))
        return out

    def spread(self, name: str) -> list[tuple[str, int]] | None:
        """For local expert parameter `name` of an `MoE` layer: [(global name, ep rank)] of the same local
        parameter on each rank of the expert group (`save_16bit_model` writes them all: `gather_spread`);
        None for any other name."""
        m = _EXPERT.match(name)
        if m is None or m["head"] not in self.sizes:
            return None
        ep, local = self.sizes[m["head"]]
        return [(f"{m['head']}{r * local + int(m['index'])}{m['tail']}", r) for r in range(ep)]

    def gather_spread(self, value):
        """[ep, *value.shape]: local expert tensor `value` of every rank of the expert group (an all-gather
        over it: every rank must call, in the same order)."""
        ep = dist.get_world_size(self.group)
        out = torch.empty(ep * value.numel(), dtype=value.dtype, device=value.device)
        start_all_gather(out, value.contiguous().view(-1), group=self.group).wait()
        return out.view(ep, *value.shape)

    def gather_full(self, param, value):
        """The full [E, ...] tensor of AutoEP fused-expert parameter `param` from this rank's rows `value` (an
        all-gather over the "expert" group: every rank of it must call, in the same order); `value` itself for
        any other parameter."""
        hit = self._by_id.get(id(param))
        if hit is None:
            return value
        out = torch.empty(hit[0] * value.numel(), dtype=value.dtype, device=value.device)
        start_all_gather(out, value.contiguous().view(-1), group=self.group).wait()
        return out.view(hit[1])

    def owns(self, name: str) -> bool:
        """Whether checkpoint entry `name` is for this rank: every non-expert entry, and the experts it holds."""
        m = _EXPERT.match(name)
        if m is None or m["head"] not in self.ranges:
            return True
        lo, hi = self.ranges[m["head"]]
        return lo <= int(m["index"]) < hi


class ChainedTranslation:
    """Tensor or pipeline parallelism composed with expert parallelism: `tp` (`checkpoint_tp.TPTranslation`:
    shards to full tensors, the experts, replicated over the tensor group, written by its first rank; or
    `checkpoint_pipe.PipeTranslation`: a stage's layers under their global names) and then `ex`
    (`ExpertTranslation`: global expert names, AutoEP's rows in full-tensor coordinates)."""

    def __init__(self, tp, ex: ExpertTranslation):
        self.tp, self.ex = tp, ex

    def global_name(self, name: str) -> str:
        return self.ex.global_name(name)

    def full_shape(self, name: str, shape) -> tuple:
        return self.ex.full_shape(name, self.tp.full_shape(name, shape))

    def frags(self, frags, *, load: bool):
        return self.ex.frags(self.tp.frags(frags, load=load), load=load)

    def owns(self, name: str) -> bool:
        return getattr(self.tp, "owns", lambda n: True)(name) and self.ex.owns(name)
