"""zerospeed.moe dropless routing (drop_tokens=False) over an expert-parallel group of 2 real gloo ranks:
every rank's capacity is the largest expert load over the group (an all-reduce MAX), as in DeepSpeed,
so the ranks' expert buffers have the same shape; without a group each rank uses its own largest load."""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerospeed.moe.sharded_moe import TopKGate, top1gating, top2gating, topkgating
from zerospeed.testing.spawn import run_distributed

# each token's experts in order of preference (4 experts); rank 0's loads are larger than rank 1's
PREFERENCES = {0: [[0, 1, 2]] * 6 + [[1, 2, 3]] * 2,
               1: [[0, 1, 2], [1, 2, 3], [2, 3, 0], [3, 0, 1]] * 2}


def _logits(rank):
    logits = torch.zeros(8, 4)
    for token, experts in enumerate(PREFERENCES[rank]):
        logits[token, experts] = torch.tensor([3.0, 2.0, 1.0])
    return logits


def _body(rank, world):
    logits = _logits(rank)
    group = dist.group.WORLD
    gatings = {"top1": lambda g: top1gating(logits, 1.0, 0, drop_tokens=False, ep_group=g),
               "top2": lambda g: top2gating(logits, 1.0, 0, drop_tokens=False, ep_group=g,
                                            top2_2nd_expert_sampling=False),
               "top3": lambda g: topkgating(logits, 3, 1.0, 0, drop_tokens=False, ep_group=g)}
    # (capacity over the group, capacity alone)
    out = {name: (gating(group)[1].shape[2], gating(None)[1].shape[2]) for name, gating in gatings.items()}
    gate = TopKGate(4, 4, k=2, drop_tokens=False, ep_group=group, top2_2nd_expert_sampling=False)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.eye(4))
    out["gate"] = gate(logits)[1].shape[2]
    return out


def test_dropless_capacity_is_the_group_maximum():
    r0, r1 = run_distributed(_body, 2)
    assert (r0["top1"], r1["top1"]) == ((6, 6), (6, 2))    # largest first-choice load: 6 and 2
    assert (r0["top2"], r1["top2"]) == ((8, 8), (8, 4))    # rank 0's expert 1 gets all 8 tokens
    assert (r0["top3"], r1["top3"]) == ((8, 8), (8, 6))
    assert r0["gate"] == r1["gate"] == 8
