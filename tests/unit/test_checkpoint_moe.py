"""`runtime.checkpoint_moe.ExpertTranslation`: local expert names <-> global expert ids (no processes)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.moe.layer import MoE
from zerospeed.runtime.checkpoint_moe import ExpertTranslation
from zerospeed.zero.fragments import LogicalParam

M = 4


class Net(nn.Module):
    def __init__(self, ep: int = 2):
        super().__init__()
        self.dense = nn.Linear(M, M)
        self.moe = MoE(M, nn.Linear(M, M), num_experts=4, ep_size=ep)


def test_local_experts_get_global_ids():
    t = ExpertTranslation(Net(), ep_rank=1)
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    assert t.global_name(prefix + "0.weight") == prefix + "2.weight"
    assert t.global_name(prefix + "1.bias") == prefix + "3.bias"
    assert t.global_name("dense.weight") == "dense.weight"
    assert t.global_name("moe.deepspeed_moe.gate.wg.weight") == "moe.deepspeed_moe.gate.wg.weight"
    assert [t.owns(prefix + f"{e}.weight") for e in range(4)] == [False, False, True, True]
    assert t.owns("dense.weight") and t.full_shape("dense.weight", torch.Size([4, 4])) == (4, 4)
    lp = LogicalParam(prefix + "1.weight", (), (M, M), torch.float32)
    (out, start, end, take), = t.frags([(lp, 0, 16, None)], load=False)
    assert (out.name, start, end, out.shape) == (prefix + "3.weight", 0, 16, (M, M))


def test_ep_1_layers_keep_their_names():
    t = ExpertTranslation(Net(ep=1), ep_rank=0)
    assert t.names == {} and t.owns("moe.deepspeed_moe.experts.deepspeed_experts.3.weight")


def test_experts_with_buffers_or_frozen_parameters_are_refused():
    net = Net()
    net.moe.deepspeed_moe.experts.deepspeed_experts[0].register_buffer("scale", torch.ones(1))
    with pytest.raises(NotImplementedError, match="experts with buffers"):
        ExpertTranslation(net, ep_rank=0)
    net = Net()
    net.moe.deepspeed_moe.experts.deepspeed_experts[1].bias.requires_grad_(False)
    with pytest.raises(NotImplementedError, match="frozen expert parameters"):
        ExpertTranslation(net, ep_rank=0)
