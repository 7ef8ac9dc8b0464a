"""BackwardSteps (super_offload) on its worker thread, real swap files, one process: the tiles it steps
beside the caller equal torch's AdamW in memory bit for bit; deferred tiles wait for poll(); settle(m)
returns only once m's tiles are stepped; a worker error reaches the caller."""
import threading
import time

import pytest
import torch

from zerospeed.offload.aio import AsyncIO
from zerospeed.offload.backward_steps import BackwardSteps
from zerospeed.offload.grads import SwappedGrads
from zerospeed.offload.optimizer import SwappedOptimizer
from zerospeed.offload.swap import SwapSpace


@pytest.fixture
def swap(tmp_path):
    aio = AsyncIO(block_size=1 << 16)
    space = SwapSpace(tmp_path, rank=0, aio=aio)
    yield space
    space.close()
    aio.close()


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _setup(swap, shapes=((13, 5), (37,), (8, 4))):
    """A SwappedOptimizer over masters of `shapes` after its first step, with the reference AdamW in memory
    stepped the same way; `compute` receives the written tiles."""
    torch.manual_seed(0)
    init = [torch.randn(*s) for s in shapes]
    ref = [t.clone().requires_grad_() for t in init]
    ref_opt = _adamw(ref)
    sw = SwappedOptimizer(make_optimizer=_adamw, swap=swap, sub_group_size=16)
    for t in init:
        sw.add_master(t)
    sw.build()
    compute = [torch.zeros_like(t) for t in init]

    def write(m, rows, values):
        compute[m][rows[0]:rows[1]].copy_(values)
    grads = [torch.randn_like(t) for t in init]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    ref_opt.step()
    sw.step(grads, write)
    return sw, ref, ref_opt, compute, write


def test_worker_steps_equal_in_memory_adamw(swap):
    """Three backwards of three masters submitted in reverse order (as a backward reduces them): every tile
    stepped on the worker, values equal to AdamW in memory; max_pending=1 bounds the gradients held."""
    sw, ref, ref_opt, compute, write = _setup(swap)
    bs = BackwardSteps(sw, write, sets=2, max_pending=1)
    main = threading.current_thread()
    seen = []
    bs.write_param = lambda m, rows, v: (seen.append(threading.current_thread()), write(m, rows, v))
    for step in range(3):
        bs.start_backward()
        grads = [torch.randn_like(r) for r in ref]
        for m in reversed(range(len(ref))):
            assert bs.takes(m)
            bs.submit(m, grads[m].reshape(-1).clone())
            assert len(bs._holding) <= 1
        done = bs.finish()
        assert done == set(range(len(sw.tiles))) and not bs.busy
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        ref_opt.step()
        for m, r in enumerate(ref):
            assert torch.equal(compute[m], r.detach()), (step, m)
            assert torch.equal(sw.read_master(m), r.detach()), (step, m)
    assert bs.stepped == 3 * len(sw.tiles) and bs.stepped_deferred == 0
    assert seen and all(t is not main for t in seen)  # stepped on the worker, not the caller
    bs.close()
    assert bs._thread is None


def test_deferred_tiles_wait_for_poll_and_settle(swap):
    """Stored gradients (submit_stored) start only at the next poll/settle, with the hyperparameters given
    (lr 0: unchanged values); settle(m) returns with m's values final."""
    sw, ref, ref_opt, compute, write = _setup(swap, shapes=((13, 5), (37,)))
    store = SwappedGrads(swap)
    grads = [torch.randn(r.numel()) for r in ref]
    for m, g in enumerate(grads):
        buf = store.buffer(g.numel())
        buf.copy_(g)
        store.write(m, buf, (g.double() ** 2).sum().reshape(1))
    store.drain()
    bs = BackwardSteps(sw, write, sets=3)
    before = [c.clone() for c in compute]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in sw.optimizer.param_groups]
    for m in (1, 0):
        bs.submit_stored(m, store, hyper)
    assert bs.busy and not bs._released
    time.sleep(0.3)  # time enough for the worker to step them, were they not held
    assert all(torch.equal(c, b) for c, b in zip(compute, before))  # held: nothing stepped before poll()
    sw.optimizer.param_groups[0]["lr"] = 123.0  # the scheduler moved on; the held tiles use `hyper`
    bs.poll()
    bs.settle(1)
    assert not bs._unstepped.get(1)
    bs.finish()
    assert sw.optimizer.param_groups[0]["lr"] == 123.0
    for r, g in zip(ref, grads):
        r.grad = g.view(r.shape).clone()
    ref_opt.step()
    for m, r in enumerate(ref):
        assert torch.equal(compute[m], r.detach()), m
    assert bs.stepped_deferred == len(sw.tiles)
    bs.close()


def test_worker_error_reaches_the_caller(swap):
    """An exception in write_param on the worker is raised, chained, at the caller's next wait."""
    sw, ref, _, _, _ = _setup(swap)

    def broken(m, rows, values):
        raise ValueError("disk on fire")
    bs = BackwardSteps(sw, broken, sets=2, max_pending=8)
    bs.start_backward()
    bs.submit(0, torch.zeros(ref[0].numel()))
    with pytest.raises(RuntimeError, match="super_offload.*disk on fire") as info:
        bs.finish()
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RuntimeError, match="disk on fire"):
        bs.poll()
    bs.close()
