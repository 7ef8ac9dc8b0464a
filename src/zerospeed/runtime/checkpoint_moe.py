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
"""
from __future__ import annotations

import re

from torch import nn

__all__ = ["ExpertTranslation"]

_EXPERT = re.compile(r"^(?P<head>.*\.deepspeed_experts\.)(?P<index>\d+)(?P<tail>\..*)$")


class ExpertTranslation:
    """Local <-> global names of this rank's experts. module: the model; ep_rank: this rank's index in its
    "expert" group. Raises NotImplementedError for experts with buffers or frozen parameters (written by
    their local names: they would collide across the expert group)."""

    def __init__(self, module: nn.Module, ep_rank: int):
        from .moe_setup import moe_layers

        self.names: dict[str, str] = {}
        self.ranges: dict[str, tuple[int, int]] = {}  # layer prefix "<...>.deepspeed_experts." -> global ids held
        layer_of = {id(m): n for n, m in module.named_modules()}
        for layer in moe_layers(module):
            if layer.ep_size == 1:
                continue
            local = layer.num_local_experts
            prefix = f"{layer_of[id(layer.experts)]}.deepspeed_experts."
            self.ranges[prefix] = (ep_rank * local, (ep_rank + 1) * local)
            for n, _ in layer.experts.named_buffers():
                raise NotImplementedError(f"checkpoints of experts with buffers ({prefix}{n}) under expert "
                                          "parallelism are not supported yet")
            for n, p in layer.experts.named_parameters():
                if not p.requires_grad:
                    raise NotImplementedError(f"checkpoints of frozen expert parameters ({prefix}{n}) under expert "
                                              "parallelism are not supported yet")
        for n, _ in module.named_parameters(remove_duplicate=False):
            m = _EXPERT.match(n)
            if m and m["head"] in self.ranges:
                self.names[n] = f"{m['head']}{self.ranges[m['head']][0] + int(m['index'])}{m['tail']}"

    def global_name(self, name: str) -> str:
        """The checkpoint name of local parameter `name` (its own name unless it is an expert's)."""
        return self.names.get(name, name)

    def full_shape(self, name: str, shape) -> tuple:
        return tuple(shape)

    def frags(self, frags, *, load: bool):
        """A slot's fragments [(LogicalParam, start, end, take)] under the global expert names."""
        return [(type(lp)(self.global_name(lp.name), lp.aliases, lp.shape, lp.dtype), start, end, take)
                for lp, start, end, take in frags]

    def owns(self, name: str) -> bool:
        """Whether checkpoint entry `name` is for this rank: every non-expert entry, and the experts it holds."""
        m = _EXPERT.match(name)
        if m is None or m["head"] not in self.ranges:
            return True
        lo, hi = self.ranges[m["head"]]
        return lo <= int(m["index"]) < hi
