"""Tensor-parallel shards in the topology-independent checkpoint format.

A checkpoint stores *full* logical tensors as flat fragments (`zero/fragments.py`). Under tensor
parallelism a rank's ZeRO slots hold pieces of its *shard*; `TPTranslation` maps each such piece to the
runs of the full tensor it covers (`tensor_parallel.layers.shard_pieces`), so every rank of the world writes
disjoint fragments of the full tensors and any later run - another tp size, another dp size, no tensor
parallelism at all, `zerospeed to-fp32` - reads them as it reads any checkpoint. Replicated parameters
(norms, embeddings) are written by tensor-parallel rank 0 only (each element once) and read by every rank.
"""
from __future__ import annotations

import torch

from ..comm.ops import start_all_gather
from ..tensor_parallel import tensor_parallel_layers, unshard_tensors
from ..tensor_parallel.layers import shard_pieces

__all__ = ["TPTranslation"]


class TPTranslation:
    """Shard <-> full-tensor mapping of a model's tensor-parallel parameters, by canonical parameter name.

    specs: {name: (ShardSpec, full shape)}; writes_replicated: this rank writes replicated tensors
    (tensor-parallel rank 0). group / size: the tensor-parallel group, for `gather_full`."""

    def __init__(self, module: torch.nn.Module, mesh):
        self.group, self.size = mesh.group("tensor"), mesh.size("tensor")
        self.writes_replicated = mesh.rank("tensor") == 0
        names = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        self.specs: dict[str, tuple] = {}
        self._by_id: dict[int, tuple] = {}
        for _, layer in tensor_parallel_layers(module):
            for pn, spec in layer.shard_specs.items():
                p = getattr(layer, pn)
                if spec is None or p is None:
                    continue
                full = tuple(layer.full_shapes[pn])
                self.specs[names[id(p)]] = (spec, full)
                self._by_id[id(p)] = (spec, full)
        frozen = [names[id(p)] for _, layer in tensor_parallel_layers(module) for p in layer.parameters()
                  if not p.requires_grad and id(p) in self._by_id]
        if frozen:
            raise NotImplementedError(f"frozen tensor-parallel parameters ({frozen[0]}, ...) cannot be checkpointed "
                                      "yet: they are written whole per rank; unfreeze them or drop tensor parallelism")

    def full_shape(self, name: str, shape) -> tuple:
        """The full shape of parameter `name` (its own shape when it is not sharded)."""
        hit = self.specs.get(name)
        return hit[1] if hit else tuple(shape)

    def frags(self, frags, *, load: bool):
        """Translate a slot's fragments [(LogicalParam, start, end, take)] from shard to full coordinates;
        on save, drop replicated ones unless this rank writes them."""
        out = []
        for lp, start, end, take in frags:
            hit = self.specs.get(lp.name)
            if hit is None:
                if load or self.writes_replicated:
                    out.append((lp, start, end, take))
                continue
            spec, full = hit
            lp_full = type(lp)(lp.name, lp.aliases, full, lp.dtype)
            for loc, g, n in shard_pieces(spec, full, start, end):
                out.append((lp_full, g, g + n, (lambda a, b, t0=take: lambda t: t0(t)[a:b])(loc - start, loc - start + n)))
        return out

    def gather_full(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The full tensor of tensor-parallel parameter `param` from this rank's shard `value` (an
        all-gather over the tensor group: every rank of it must call, in the same order); `value`
        itself for a replicated parameter."""
        hit = self._by_id.get(id(param))
        if hit is None:
            return value
        out = torch.empty(self.size * value.numel(), dtype=value.dtype, device=value.device)
        start_all_gather(out, value.contiguous().view(-1), group=self.group).wait()
        return unshard_tensors(list(out.view(self.size, *value.shape).unbind(0)), hit[0])
