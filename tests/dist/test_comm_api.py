"""DeepSpeed's `deepspeed.comm` API as `zerospeed.comm` on 2 real gloo ranks: every function gives the
textbook numbers (rank r contributes values derived from r)."""
from __future__ import annotations

import pytest
import torch

import zerospeed
import zerospeed.comm as dist
from zerospeed.testing.spawn import run_distributed


def _body(rank, world):
    out = {}
    assert dist.is_initialized() and dist.is_available()
    out["rank"], out["world"], out["local"] = dist.get_rank(), dist.get_world_size(), dist.get_local_rank()
    dist.barrier()

    t = torch.tensor([1.0, 2.0]) * (rank + 1)
    assert dist.all_reduce(t) is None
    out["sum"] = t.tolist()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["max"] = t.item()
    t = torch.tensor([1.0, 4.0]) * (rank + 1)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)  # gloo has no AVG: SUM / world
    out["avg"] = t.tolist()
    t = torch.tensor([3.0]) * (rank + 1)
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    out["avg_async"] = t.item()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, dist.ReduceOp.SUM, None, True).wait()  # positional, as DeepSpeed's signature
    out["sum_async"] = t.item()

    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=1)
    out["bcast"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    dist.broadcast(t, 0, None, True).wait()
    out["bcast_async"] = t.tolist()

    t = torch.tensor([float(rank + 1)] * 2)
    dist.reduce(t, dst=0)
    if rank == 0:
        out["reduce"] = t.tolist()
    t = torch.tensor([float(rank + 1)])
    dist.reduce(t, 1, op=dist.ReduceOp.AVG)
    if rank == 1:
        out["reduce_avg"] = t.item()

    parts = [torch.empty(2) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([rank, 10.0 * rank]))
    out["all_gather"] = [p.tolist() for p in parts]
    flat = torch.empty(world * 3)
    dist.all_gather_into_tensor(flat, torch.arange(3.0) + 100 * rank)
    out["all_gather_into_tensor"] = flat.tolist()

    own = torch.empty(2)
    dist.reduce_scatter_tensor(own, torch.arange(2.0 * world) * (rank + 1))
    out["reduce_scatter_tensor"] = own.tolist()
    dist.reduce_scatter_tensor(own, torch.arange(2.0 * world) * (rank + 1), op=dist.ReduceOp.AVG)
    out["reduce_scatter_avg"] = own.tolist()
    own = torch.empty(1)
    dist.reduce_scatter(own, [torch.tensor([float(j + 10 * rank)]) for j in range(world)])
    out["reduce_scatter"] = own.item()

    recv_buf = torch.empty(world)
    dist.all_to_all_single(recv_buf, torch.arange(world, dtype=torch.float32) + 10 * rank)
    out["all_to_all_single"] = recv_buf.tolist()
    # uneven splits: rank r sends r+1 elements to every rank
    send = torch.full((world * (rank + 1),), float(rank))
    recv_uneven = torch.empty(sum(r + 1 for r in range(world)))
    dist.all_to_all_single(recv_uneven, send, output_split_sizes=[r + 1 for r in range(world)],
                           input_split_sizes=[rank + 1] * world)
    out["all_to_all_uneven"] = recv_uneven.tolist()

    # point to point: 0 -> 1 blocking, 1 -> 0 non-blocking
    buf = torch.empty(3)
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0, 3.0]), 1)
        req = dist.irecv(buf, src=1)
        req.wait()
        out["p2p"] = buf.tolist()
    else:
        sender = dist.recv(buf, src=0)
        out["p2p"] = buf.tolist() + [sender]
        dist.isend(buf * 2, 0).wait()

    # a subgroup of rank 1 alone: its rank 0 is global rank 1
    sub = dist.new_group([1])
    if rank == 1:
        out["sub"] = (dist.get_rank(sub), dist.get_world_size(sub), dist.get_global_rank(sub, 0))
        t = torch.tensor([5.0])
        dist.all_reduce(t, group=sub)
        out["sub_sum"] = t.item()
    pair = dist.new_group([0, 1])
    out["pair_ranks"] = dist.get_all_ranks_from_group(pair)
    out["global_world"] = dist.get_global_rank(None, 1)
    return out


def test_deepspeed_comm_functions_give_the_textbook_numbers():
    results = run_distributed(_body, 2)
    for rank, r in enumerate(results):
        assert (r["rank"], r["world"], r["local"]) == (rank, 2, rank)
        assert r["sum"] == [3.0, 6.0] and r["max"] == 2.0 and r["avg"] == [1.5, 6.0]
        assert r["avg_async"] == 4.5 and r["sum_async"] == 3.0
        assert r["bcast"] == [1.0, 1.0, 1.0] and r["bcast_async"] == [1.0, 1.0]
        assert r["all_gather"] == [[0.0, 0.0], [1.0, 10.0]]
        assert r["all_gather_into_tensor"] == [0.0, 1.0, 2.0, 100.0, 101.0, 102.0]
        # sum over ranks of arange(4) * (rank+1) = 3 * arange(4); rank r keeps rows [2r, 2r+2)
        assert r["reduce_scatter_tensor"] == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]
        assert r["reduce_scatter_avg"] == [1.5 * (2 * rank), 1.5 * (2 * rank + 1)]
        assert r["reduce_scatter"] == float(rank + (rank + 10))  # j=rank from rank 0 and rank 1
        assert r["all_to_all_single"] == [float(rank), float(rank + 10)]
        assert r["all_to_all_uneven"] == [0.0, 1.0, 1.0]
        assert r["pair_ranks"] == [0, 1] and r["global_world"] == 1
    assert results[0]["reduce"] == [3.0, 3.0] and results[1]["reduce_avg"] == 1.5
    assert results[1]["p2p"] == [1.0, 2.0, 3.0, 0]
    assert results[0]["p2p"] == [2.0, 4.0, 6.0]
    assert results[1]["sub"] == (0, 1, 1) and results[1]["sub_sum"] == 5.0


def test_the_public_names_are_deepspeeds():
    """Package level: DeepSpeed's signatures (not `comm.ops`' keyword-only internal ones)."""
    import inspect

    assert list(inspect.signature(dist.all_reduce).parameters) == ["tensor", "op", "group", "async_op"]
    assert list(inspect.signature(dist.broadcast).parameters) == ["tensor", "src", "group", "async_op"]
    assert dist.ReduceOp.SUM == torch.distributed.ReduceOp.SUM
    assert zerospeed.comm.init_distributed is zerospeed.init_distributed


def test_before_init_rank_queries_raise_with_the_fix():
    if torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    assert dist.is_initialized() is False
    for fn in (dist.get_rank, dist.get_world_size, dist.barrier):
        with pytest.raises(RuntimeError, match="init_distributed"):
            fn()
    with pytest.raises(RuntimeError, match="init_distributed"):
        dist.all_reduce(torch.ones(1))
