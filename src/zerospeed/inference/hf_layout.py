"""Checkpoints in a model's original layout, read as transformers 5 builds the model: per-expert MoE weights
fused on the fly.

transformers 5 keeps the experts of Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, ... as fused 3-D tensors
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), but the checkpoints on the Hub,
and those `save_pretrained` writes, keep the original per-expert layout (`block_sparse_moe.experts.3.w1.weight`
...): `from_pretrained` converts on load with the model type's table,
`transformers.conversion_mapping.get_checkpoint_conversion_mapping`. `ConvertedReader` applies that same
table to a reader of `inference/load.py`, reading only the experts asked for: a rank of an expert group
(`moe.ep_size`) reads its own experts' files, never the others'. Of the table it interprets renamings and
converters made of `MergeModulelist(dim=0)` (stack the experts) optionally followed by `Concatenate` (join
the sources, e.g. [gate; up]); a model whose table needs another operation gets a ValueError naming it.
"""
from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["ConvertedReader", "converted"]


def _table(model: nn.Module):
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4.x: checkpoints are in the model's own layout
        return []
    return (get_checkpoint_conversion_mapping(model_type) or []) if model_type else []


def _glob(pattern: str) -> re.Pattern:
    """A conversion pattern ('.experts.*.w1.weight': '*' an expert index) as a regex capturing the index."""
    return re.compile("(?:" + r"(\d+)".join(re.escape(p) for p in pattern.split("*")) + ")$")


class ConvertedReader:
    """`base` (a `load.SafetensorsReader` / `StateDictReader`) under the model's names: renamed keys, and each
    converter's target (`prefix + target pattern`) built from its per-expert sources. `read(name, spec)`: spec
    None (every expert) or a (start, end) range of experts; a tensor-parallel ShardSpec of a fused tensor is
    a ValueError."""

    def __init__(self, base, renamings: list, converters: list):
        self.base = base
        self.plain: dict[str, str] = {}  # model name -> stored name
        self.fused: dict[str, tuple[list[dict[int, str]], int | None]] = {}  # model name -> (per source: e -> key, dim)
        for stored in sorted(base.names()):
            name = stored
            for old, new in renamings:
                name = re.sub(old, new, name)
            for sources, target, concat in converters:
                hit = next(((i, m) for i, p in enumerate(sources) for m in [p.search(name)] if m), None)
                if hit is not None:
                    i, m = hit
                    key = name[:m.start()] + target
                    parts, _ = self.fused.setdefault(key, ([{} for _ in sources], concat))
                    parts[i][int(m.group(1))] = stored
                    break
            else:
                self.plain[name] = stored

    def names(self) -> set[str]:
        return set(self.plain) | set(self.fused)

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of `name` as the model holds it (a fused tensor: [E, ...] of its stacked, joined sources)."""
        if name in self.plain:
            return self.base.shape(self.plain[name])
        parts, concat = self.fused[name]
        shapes = [list(self.base.shape(next(iter(p.values())))) for p in parts]
        out = [len(parts[0])] + shapes[0]
        if concat is not None:
            out[concat] = sum(([len(parts[0])] + s)[concat] for s in shapes)
        return tuple(out)

    def read(self, name: str, spec=None) -> torch.Tensor:
        if name in self.plain:
            return self.base.read(self.plain[name], spec)
        parts, concat = self.fused[name]
        count = len(parts[0])
        if spec is not None and not isinstance(spec, tuple):
            raise ValueError(f"{name}: a tensor-parallel split of fused experts read from per-expert checkpoint "
                             "tensors is not implemented; split the experts with moe.ep_size instead")
        lo, hi = spec if spec is not None else (0, count)
        missing = [e for e in range(lo, hi) for p in parts if e not in p]
        if missing:
            raise ValueError(f"{name}: the checkpoint lacks experts {sorted(set(missing))[:8]} of this tensor")
        stacked = [torch.stack([self.base.read(p[e]) for e in range(lo, hi)]) for p in parts]
        return torch.cat(stacked, dim=concat) if concat is not None else stacked[0]


def converted(reader, model: nn.Module):
    """`reader` itself when it holds every parameter name of `model`; else a `ConvertedReader` with the model
    type's conversion table (or `reader` when there is none). Raises ValueError for a table operation it does
    not implement, naming it."""
    want = {n for n, _ in model.named_parameters()}
    if want <= reader.names():
        return reader
    renamings, converters = [], []
    for t in _table(model):
        kind = type(t).__name__
        sources, targets = list(t.source_patterns), list(t.target_patterns)
        if kind == "WeightRenaming":
            renamings += [(s, d) for s, d in zip(sources, targets)]
            continue
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(t, "operations", [])]
        names = [n for n, _ in ops]
        if kind != "WeightConverter" or len(targets) != 1 or ops[:1] != [("MergeModulelist", 0)] \
                or names[1:] not in ([], ["Concatenate"]):
            raise ValueError(f"checkpoint conversion {kind}({sources} -> {targets}, operations {names}) of model type "
                             f"{model.config.model_type!r} is not implemented for init_inference(checkpoint=...): load the "
                             "model with from_pretrained and pass it without checkpoint")
        concat = ops[1][1] if len(ops) > 1 else None
        converters.append(([_glob(s) for s in sources], targets[0], concat))
    if not renamings and not converters:
        return reader
    return ConvertedReader(reader, renamings, converters)
