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


class CountingAll(GroupCollectives):
    """Counts every collective a strategy starts through its `comms`, then runs the plain one."""

    counts: dict = {}

    def _count(self, name, n):
        CountingAll.counts[name] = CountingAll.counts.get(name, 0) + n

    def start_all_reduce(self, tensor):
        self._count("all_reduce", tensor.numel())
        return super().start_all_reduce(tensor)

    def start_reduce_scatter(self, output, input, **kw):
        self._count("reduce_scatter", input.numel())
        return super().start_reduce_scatter(output, input, **kw)

    def start_all_gather(self, output, input):
        self._count("all_gather", output.numel())
        return super().start_all_gather(output, input)


def _strategy_seam(rank, world):
    """build_strategy(collectives=CountingAll) at every stage: the subclass carries every gradient reduction
    and parameter all-gather, and the step equals the default implementation's."""
    from zerospeed.config import load_config
    from zerospeed.testing.models import random_tokens, tiny_gpt
    from zerospeed.zero.factory import build_strategy

    out = {}
    for stage in (0, 1, 2, 3):
        results = []
        for cls in (GroupCollectives, CountingAll):
            CountingAll.counts = {}
            model = tiny_gpt(seed=0, bias=False)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            zero_cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
                "stage": stage, "reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 0}}).zero_optimization
            s = build_strategy(stage, module=model, optimizer=opt, group=None, zero_cfg=zero_cfg,
                               collectives=cls)
            x = random_tokens(2, 16, seed=rank)
            s.arm()
            model(x[:, :-1], x[:, 1:]).backward()
            s.finish()
            norm = s.clip_and_norm(0.0)
            s.optimizer_step()
            s.zero_grad()
            s.disarm()
            results.append((norm, dict(CountingAll.counts)))
            s.remove()
        out[stage] = results
    return out


def test_a_collectives_subclass_handed_to_build_strategy_carries_every_stage():
    psi = sum(p.numel() for p in __import__("zerospeed.testing.models", fromlist=["tiny_gpt"]).tiny_gpt(
        seed=0, bias=False).parameters())
    for res in run_distributed(_strategy_seam, 2):
        for stage, ((norm_plain, plain_counts), (norm_sub, counts)) in res.items():
            assert norm_plain == norm_sub and not plain_counts, stage
            if stage == 0:
                assert counts == {"all_reduce": psi}  # the gradient buckets
            else:  # reduce-scatter of the gradient, all-gather of the parameters (stage 3: forward too)
                assert counts.get("reduce_scatter", 0) >= psi and counts.get("all_gather", 0) >= psi, (stage, counts)
