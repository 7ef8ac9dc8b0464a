"""`comm.collectives.GroupCollectives` on real gloo ranks: over a sub-group it uses the rank in that group,
gives the textbook results and counts them; a subclass handed to a reducer is what the reducer calls."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerospeed.comm.collectives import GroupCollectives
from zerospeed.comm.logger import CommsLogger
from zerospeed.testing.spawn import run_distributed
from zerospeed.zero.data_parallel import GradientAllReducer


class CountingCollectives(GroupCollectives):
    """A stand-in for a compressed implementation: counts its all-reduces, then runs the plain one."""

    calls: list = []

    def start_all_reduce(self, tensor):
        self.calls.append(tensor.numel())
        return super().start_all_reduce(tensor)


def _body(rank, world):
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both, in one order
    log = CommsLogger(enabled=True)
    comms = GroupCollectives(groups[rank % 2], log)
    me, peer = rank // 2, (rank + 2) % 4  # rank in the pair; the other member's global rank
    assert (comms.world_size, comms.rank) == (2, me)
    k = 5
    t = torch.full((k,), float(rank))
    comms.start_all_reduce(t).wait()
    assert torch.equal(t, torch.full((k,), float(rank + peer)))
    gathered = torch.empty(2 * k)
    comms.start_all_gather(gathered, torch.full((k,), float(rank))).wait()
    assert torch.equal(gathered, torch.cat([torch.full((k,), float(r)) for r in sorted((rank, peer))]))
    scratch = torch.arange(2 * k, dtype=torch.float32) + rank
    own = scratch[me * k:(me + 1) * k]
    comms.start_reduce_scatter(own, scratch, input_is_scratch=True).wait()
    assert torch.equal(own, 2 * torch.arange(me * k, (me + 1) * k, dtype=torch.float32) + rank + peer)
    counts = {name: (s.calls, s.elements) for name, s in log.stats.items()}
    # the seam: a reducer given a subclass calls it (and averages over its group of 2)
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    counting = CountingCollectives(groups[rank % 2], None)
    reducer = GradientAllReducer(list(lin.parameters()), comms=counting, bucket_size=4)
    reducer.arm()
    (lin(torch.full((1, 3), float(rank))).sum()).backward()
    reducer.finish()
    lin_ref = nn.Linear(3, 2)
    lin_ref.load_state_dict(lin.state_dict())
    (lin_ref(torch.full((1, 3), float(rank))).sum() + lin_ref(torch.full((1, 3), float(peer))).sum()).backward()
    for p, ref in zip(lin.parameters(), lin_ref.parameters()):
        assert torch.allclose(p.grad, ref.grad / 2)
    return counts, counting.calls


def test_group_collectives_over_a_sub_group_and_a_subclass_seam():
    for counts, calls in run_distributed(_body, 4):
        assert counts == {"all_reduce": (1, 5), "all_gather": (1, 10), "reduce_scatter": (1, 10)}
        assert calls == [2, 6]  # two buckets (bias 2 | weight 6 with bucket_size 4), backward order
