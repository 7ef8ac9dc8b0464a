"""Vocabulary-parallel token embedding and lm_head for tensor-parallel serving (Megatron-LM's
`VocabParallelEmbedding` and parallel output layer: Shoeybi et al. 2019, §3).

The [vocab, hidden] table is cut by rows: rank r of tp holds rows [r x ceil(V / tp), min(V, (r + 1) x
ceil(V / tp))) (GPT-2's 50,257 rows do not divide by 2: the last rank holds fewer). For a 124M GPT-2 the
table is 31% of the weights, so without this a tp-2 rank would hold 0.66 of the model instead of ~0.5.

* embedding: ids [...] -> [..., hidden]: each rank looks up the ids in its range (zeros elsewhere), then
  one all-reduce (sum) over the tp group;
* lm_head: x [..., hidden] -> logits [..., V]: each rank computes its rows' logits [..., rows], padded to
  ceil(V / tp), then one all-gather along the last dimension (the padding is cut off).

A tied table (GPT-2's wte = lm_head) stays one Parameter shared by both modules, under both names, as HF
ties it. Inference only (no autograd through the collectives); `comm.traced`'s collectives, which
`torch.compile` traces into a compiled decode step (and which run eagerly in the prefill). The modules keep the
names `weight`, so a checkpoint's `transformer.wte.weight` loads into them (`inference/load.py` reads only the
rank's rows).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm.traced import traced_all_gather, traced_all_reduce

__all__ = ["VocabParallelEmbedding", "VocabParallelLMHead", "shard_vocab", "vocab_range"]


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of a vocab-row table that rank `rank` of `tp` holds (the last may hold fewer)."""
    per = -(-vocab // tp)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


class _VocabParallel(nn.Module):
    def __init__(self, weight: nn.Parameter, *, vocab: int, group, tp: int, rank: int):
        super().__init__()
        self.weight = weight  # [rows, hidden]: rows [start, end) of the full table
        self.vocab, self.group, self.tp, self.rank = vocab, group if group is not None else dist.group.WORLD, tp, rank
        self.start, self.end = vocab_range(vocab, tp, rank)
        self.per = -(-vocab // tp)
        self.int8 = None  # an Int8Matmul replacing `weight` (inference/quant.py)
        self.int8_dtype: torch.dtype | None = None  # the float dtype of the replaced weight

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, rows [{self.start}, {self.end}) of tp={self.tp}"


class VocabParallelEmbedding(_VocabParallel):
    """ids [...] (int64) -> embeddings [..., hidden], one all-reduce of the result."""

    def __init__(self, weight, *, vocab, group, tp, rank, padding_idx=None):
        super().__init__(weight, vocab=vocab, group=group, tp=tp, rank=rank)
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = vocab, (weight.shape[1] if weight is not None else 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.end - self.start)
        local = torch.where(inside, local, torch.zeros_like(local))
        if self.int8 is not None:
            dtype = self.int8_dtype
            rows = F.embedding(local, self.int8.qweight).to(dtype) * self.int8.scale[local].unsqueeze(-1).to(dtype)
        else:
            rows = F.embedding(local, self.weight)
        rows = rows * inside.unsqueeze(-1).to(rows.dtype)
        return traced_all_reduce(rows, self.group)


class VocabParallelLMHead(_VocabParallel):
    """x [..., hidden] -> logits [..., vocab], one all-gather of the rank's rows' logits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.int8(x) if self.int8 is not None else F.linear(x, self.weight)
        if y.shape[-1] < self.per:
            y = F.pad(y, (0, self.per - y.shape[-1]))
        full = traced_all_gather(y, self.group)
        return full[..., :self.vocab]


def _row_shard(weight: torch.Tensor, vocab: int, tp: int, rank: int) -> nn.Parameter:
    start, end = vocab_range(vocab, tp, rank)
    return nn.Parameter(weight.detach()[start:end].clone(), requires_grad=False)


def shard_vocab(model: nn.Module, *, group, tp: int, rank: int) -> list[str]:
    """Replace a HF model's input embedding (`get_input_embeddings`, an nn.Embedding) and output projection
    (`get_output_embeddings`, an nn.Linear without bias over the same vocabulary) by vocab-parallel ones,
    sharing one shard when they share one table. Returns the replaced module names ([] for a model
    without those HF accessors, which then stays replicated)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not callable(get_in) or not callable(get_out):
        return []
    emb, head = get_in(), get_out()
    if not isinstance(emb, nn.Embedding):
        return []
    vocab = emb.num_embeddings
    names = {id(m): n for n, m in model.named_modules()}
    done = []
    shard = _row_shard(emb.weight, vocab, tp, rank)
    new_emb = VocabParallelEmbedding(shard, vocab=vocab, group=group, tp=tp, rank=rank, padding_idx=emb.padding_idx)
    tied = isinstance(head, nn.Linear) and head.weight is emb.weight
    _replace(model, names[id(emb)], new_emb)
    done.append(names[id(emb)])
    if isinstance(head, nn.Linear) and head.bias is None and head.out_features == vocab:
        head_shard = shard if tied else _row_shard(head.weight, vocab, tp, rank)
        _replace(model, names[id(head)], VocabParallelLMHead(head_shard, vocab=vocab, group=group, tp=tp, rank=rank))
        done.append(names[id(head)])
    return done


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
