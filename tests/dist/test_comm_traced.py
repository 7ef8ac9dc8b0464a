"""`comm.traced` on real gloo ranks: the point-to-point all-reduce and all-gather a compiled decode step holds.
Eager and compiled (fullgraph, inductor's C++ wrapper: the reason they exist) results equal the textbook
definition summed in rank order, bit for bit, on every rank, over the world and over sub-groups."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerospeed.comm.traced import needs_python_wrapper, traced_all_gather, traced_all_reduce
from zerospeed.testing.spawn import run_distributed


def _x(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, 5, generator=g)  # random: a sum in another order would differ in the last bits


def _step(x, group):
    return traced_all_gather(traced_all_reduce(x * 2, group) + 1, group)


def _want(ranks):
    total = _x(ranks[0]) * 2
    for r in ranks[1:]:
        total = total + _x(r) * 2
    return torch.cat([total + 1] * len(ranks), dim=-1)


def _body(rank, world, compile):
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
    out = {"python_wrapper": needs_python_wrapper(None)}
    for name, group, ranks in [("world", None, list(range(world)))] + [
            (f"half{i}", g, [2 * i, 2 * i + 1]) for i, g in enumerate(halves) if rank in (2 * i, 2 * i + 1)]:
        want = _want(ranks)
        eager = _step(_x(rank), group)
        traced = eager
        if compile:
            torch._dynamo.reset()  # a group is a constant of the traced graph (an engine has one tp group)
            compiled = torch.compile(_step, fullgraph=True, options={"cpp_wrapper": True})
            with torch.no_grad():
                traced = compiled(_x(rank), group)
        out[name] = (torch.equal(eager, want), torch.equal(traced, want), tuple(traced.shape))
    return out


def _check(world, compile):
    for rank, out in enumerate(run_distributed(_body, world, compile, timeout=300)):
        assert out["python_wrapper"] is False  # gloo: the C++ wrapper can call these
        assert out["world"] == (True, True, (2, 5 * world)), (world, rank, out)
        if world == 4:
            assert out[f"half{rank // 2}"] == (True, True, (2, 10)), (rank, out)


def test_traced_collectives_equal_definition_over_world_and_subgroups():
    _check(4, compile=False)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_traced_collectives_compiled_with_cpp_wrapper(world):
    _check(world, compile=True)
