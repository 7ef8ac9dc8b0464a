"""`comm.ops` collectives on real gloo ranks: the gloo all-gather runs as one broadcast per source rank
and the scratch reduce-scatter as an all-to-all + local sum; results must equal the textbook definition."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerospeed.comm.logger import CommsLogger
from zerospeed.comm.ops import start_all_gather, start_reduce_scatter
from zerospeed.testing.spawn import run_distributed


def _values(rank: int, k: int) -> torch.Tensor:
    return torch.arange(k, dtype=torch.float32) * 10 + rank


def _body(rank, world, k):
    log = CommsLogger(enabled=True)
    expect = torch.cat([_values(r, k) for r in range(world)])
    # in place: input is this rank's slice of output
    out = torch.full((world * k,), -1.0)
    out[rank * k:(rank + 1) * k] = _values(rank, k)
    start_all_gather(out, out[rank * k:(rank + 1) * k], group=None, logger=log).wait()
    assert torch.equal(out, expect)
    # out of place; two in flight at once (as ZeRO-3 prefetch does), finished in reverse order
    outs = [torch.full((world * k,), -1.0) for _ in range(2)]
    handles = [start_all_gather(o, _values(rank, k) * (j + 1), group=None, logger=log) for j, o in enumerate(outs)]
    for h in reversed(handles):
        h.wait()
    assert torch.equal(outs[0], expect) and torch.equal(outs[1], expect * 2)
    # non-contiguous output falls back to the backend's all-gather
    wide = torch.full((world * k, 2), -1.0)
    start_all_gather(wide[:, 0], _values(rank, k), group=None, logger=log).wait()
    assert torch.equal(wide[:, 0], expect) and bool((wide[:, 1] == -1).all())
    # reduce-scatter, scratch input: output is own slice; two in flight, finished in reverse order
    total = sum(torch.cat([_values(r, k) * (c + 1) for c in range(world)]) for r in range(world))
    mine = slice(rank * k, (rank + 1) * k)
    scratches = [torch.cat([_values(rank, k) * (c + 1) for c in range(world)]) * (j + 1) for j in range(2)]
    handles = [start_reduce_scatter(s[mine], s, group=None, logger=log, input_is_scratch=True) for s in scratches]
    assert not handles[1].done
    for h in reversed(handles):
        h.wait()
        h.wait()  # idempotent: summed once
    assert torch.equal(scratches[0][mine], total[mine]) and torch.equal(scratches[1][mine], total[mine] * 2)
    # reduce-scatter, input kept: untouched
    src = torch.cat([_values(rank, k) * (c + 1) for c in range(world)])
    before, own = src.clone(), torch.empty(k)
    start_reduce_scatter(own, src, group=None, logger=log).wait()
    assert torch.equal(src, before) and torch.equal(own, total[mine])
    return {name: (s.calls, s.elements) for name, s in log.stats.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_and_reduce_scatter_equal_definition_and_are_counted(world):
    k = 1001  # odd: slices not aligned to anything
    for counts in run_distributed(_body, world, k):
        assert counts == {"all_gather": (4, 4 * world * k), "reduce_scatter": (3, 3 * world * k)}
