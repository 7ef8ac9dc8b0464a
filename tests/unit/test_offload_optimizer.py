"""SwappedOptimizer and ParamSwapper on real swap files, one process: exact equality with torch in memory."""
import pytest
import torch

from zerospeed.offload.aio import AsyncIO
from zerospeed.offload.optimizer import SwappedOptimizer
from zerospeed.offload.params import ParamSwapper
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


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("sub_group_size", [7, 64, 10_000])
def test_swapped_adamw_equals_in_memory(swap, pipeline, sub_group_size):
    """Masters [13, 5] (split by rows) and [37] (by elements) stepped 4 times in tiles: bit-identical to
    AdamW over the same tensors in memory; the updated values reach the compute parameters."""
    torch.manual_seed(0)
    init = [torch.randn(13, 5), torch.randn(37)]
    ref = [t.clone().requires_grad_() for t in init]
    ref_opt = _adamw(ref)
    sw = SwappedOptimizer(make_optimizer=_adamw, swap=swap, sub_group_size=sub_group_size, pipeline=pipeline)
    for t in init:
        sw.add_master(t)
    opt = sw.build()
    compute = [torch.zeros_like(t) for t in init]
    for step in range(4):
        grads = [torch.randn_like(t) for t in init]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        ref_opt.step()

        def write(m, rows, values):
            compute[m][rows[0]:rows[1]].copy_(values)
        sw.step(grads, write)
        for m, r in enumerate(ref):
            assert torch.equal(compute[m], r.detach()), (step, m)
            assert torch.equal(sw.read_master(m), r.detach())
    expected_tiles = sum(-(-t.shape[0] // max(1, sub_group_size // (t[0].numel() if t.dim() > 1 else 1)))
                         for t in init)
    assert len(sw.tiles) == expected_tiles
    assert {int(opt.state[t.param]["step"]) for t in sw.tiles} == {4}
    # only tile buffers stay in memory: (1 master + 2 Adam states) x sets x largest tile (4 KiB-aligned,
    # plus up to 4 KiB of alignment slack per buffer)
    per_buffer = -(-sw.max_tile * 4 // 4096) * 4096 + 4096
    assert 0 < sw.resident_bytes() <= 3 * (2 if pipeline else 1) * per_buffer
    assert swap.bytes_on_disk() >= 3 * sum(t.numel() for t in init) * 4


def test_write_master_then_step(swap):
    """write_master (a GatheredParameters edit) replaces the values the next step starts from."""
    sw = SwappedOptimizer(make_optimizer=lambda p: torch.optim.SGD(p, lr=0.5), swap=swap, sub_group_size=4)
    sw.add_master(torch.zeros(10))
    sw.build()
    sw.write_master(0, torch.arange(10.0))
    out = torch.empty(10)
    sw.step([torch.ones(10)], lambda m, rows, v: out[rows[0]:rows[1]].copy_(v))
    assert torch.equal(out, torch.arange(10.0) - 0.5)


def test_param_swapper_cache_prefetch_and_store(swap):
    """The pool caches shards (a second pass over units that fit reads nothing); with fewer buffers
    than units, acquiring unit i reads its learned successor ahead; store() updates the cached copy
    and the file; max_in_cpu keeps the first units resident; a shard larger than a buffer is refused."""
    shards = [torch.full((100,), float(i)) for i in range(5)]
    ps = ParamSwapper(swap, buffer_count=4, buffer_size=100, max_in_cpu=100, dtype=torch.float32)
    kept = [ps.add(i, s.clone()) for i, s in enumerate(shards)]
    assert kept[0] is not None and all(k is None for k in kept[1:])  # 100 elements of budget: unit 0
    for _ in range(2):
        for i in range(5):
            assert torch.equal(ps.acquire(i), shards[i])
            ps.release(i)
    assert ps.reads_done == 4  # pass 1 read units 1-4 once; pass 2 found them all in the pool

    ps = ParamSwapper(swap, buffer_count=3, buffer_size=100, max_in_cpu=0, dtype=torch.float32)  # read-ahead 1
    for i, s in enumerate(shards[1:], 1):
        ps.add(i, s.clone())
    prefetched = []
    for _ in range(2):
        for i in range(1, 5):
            prefetched.append(i in ps.live)
            assert torch.equal(ps.acquire(i), shards[i])
            ps.release(i)
    # pass 1: 4 demand reads (3 buffers: unit 4 evicts unit 1); pass 2: unit 1 on demand (4 -> 1 was not
    # known yet), every later unit read ahead by its predecessor, and 4 reads ahead 1 again
    assert prefetched == [False] * 5 + [True] * 3 and ps.reads_done == 4 + 1 + 4
    ps.store(2, torch.full((100,), -2.0))
    assert 2 in ps.live and 3 not in ps.live
    # unit 2 comes from its updated cached copy; the one new read is unit 3, read ahead
    assert torch.equal(ps.acquire(2), torch.full((100,), -2.0)) and ps.reads_done == 10 and 3 in ps.live
    ps.release(2)
    for i in (3, 4, 1):  # push unit 2 out of the pool, then read it back from its file
        ps.acquire(i)
        ps.release(i)
    ps.drain()
    ps._evict(2) if 2 in ps.live else None
    assert torch.equal(ps.acquire(2), torch.full((100,), -2.0))
    ps.release(2)
    with pytest.raises(ValueError, match="buffer_size"):
        ps.add(9, torch.zeros(101))


def test_param_swapper_open_store_fills_its_buffer_in_place(swap):
    """open_store hands out the unit's own buffer (filled a tile at a time, no staging copy); while open it is
    never evicted for another unit's read; close_store writes it out and it stays the cached copy."""
    ps = ParamSwapper(swap, buffer_count=2, buffer_size=100, max_in_cpu=0, dtype=torch.float32)
    for i in range(3):
        ps.add(i, torch.full((100,), float(i)))
    ps.acquire(0)
    ps.release(0)  # unit 0 cached: the least recently used buffer from here on
    buf = ps.open_store(0)
    assert buf.data_ptr() == ps.live[0].data_ptr() and ps.reads_done == 1  # its cached buffer, nothing read
    buf[:40].fill_(-1.0)
    for i in (1, 2):  # reads through the 2-buffer pool while unit 0's is open: they share the other buffer
        assert torch.equal(ps.acquire(i), torch.full((100,), float(i)))
        ps.release(i)
    assert ps.live[0].data_ptr() == buf.data_ptr() and 1 not in ps.live and ps.extra_allocations == 0
    buf[40:].fill_(-2.0)
    ps.close_store(0)
    ps.drain()
    want = torch.cat([torch.full((40,), -1.0), torch.full((60,), -2.0)])
    reads = ps.reads_done
    assert torch.equal(ps.acquire(0), want) and ps.reads_done == reads  # the cached copy
    ps.release(0)
    ps._evict(0)
    assert torch.equal(ps.acquire(0), want)  # and the file


def test_policy_from_config_and_unsupported_keys(monkeypatch):
    """OffloadPolicy reads DeepSpeed's keys; partial offload (with an accelerator: without one the optimizer is
    on the host whatever the ratio) and GDS are errors before any process group."""
    import zerospeed
    from zerospeed.config import load_config
    from zerospeed.offload import OffloadPolicy
    zero = {"stage": 3, "sub_group_size": 123,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "pipeline_read": True},
            "offload_param": {"device": "cpu", "max_in_cpu": 7, "buffer_count": 3}}
    pol = OffloadPolicy.from_config(load_config({"train_batch_size": 2, "zero_optimization": zero}).zero_optimization)
    assert (pol.optimizer, pol.param, str(pol.optimizer_nvme_path), pol.sub_group_size, pol.pipeline) == \
        ("nvme", "cpu", "/x", 123, True)
    assert (pol.max_in_cpu, pol.param_buffer_count, pol.nvme) == (7, 3, True)
    model = torch.nn.Linear(2, 2)
    partial = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}
    with monkeypatch.context() as m:  # as on a GPU machine: the check reads only whether an accelerator exists
        m.setattr(torch.accelerator, "is_available", lambda: True)
        with pytest.raises(NotImplementedError, match="offload_optimizer.ratio=0.5"):
            zerospeed.initialize(model=model, config={"train_batch_size": 1, "zero_optimization": partial})
    with pytest.raises(NotImplementedError, match="use_gds"):
        zerospeed.initialize(model=model, config={"train_batch_size": 1, "aio": {"use_gds": True}})
    with pytest.raises(ValueError, match="use None, 'cpu' or 'nvme'"):
        zerospeed.zero.Init(remote_device="disk")
    for cfg in (None, {"zero_optimization": {"offload_param": {"device": "cpu"}}}):
        with pytest.raises(ValueError, match="offload_param.nvme_path"):
            zerospeed.zero.Init(remote_device="nvme", config_dict_or_path=cfg)


def test_param_swapper_beyond_the_pool(swap):
    """More shards in use at once than buffers (many all-gathers in flight): extra buffers, no error."""
    ps = ParamSwapper(swap, buffer_count=2, buffer_size=10, max_in_cpu=0, dtype=torch.float32)
    for i in range(4):
        ps.add(i, torch.full((10,), float(i)))
    held = [ps.acquire(i) for i in range(4)]
    assert [float(h[0]) for h in held] == [0.0, 1.0, 2.0, 3.0] and ps.extra_allocations == 2
    for i in range(4):
        ps.release(i)
    assert not ps._extra and len(ps.live) == 2  # the temporaries are freed, the pool keeps its 2 shards


def test_swapped_grads_round_trip(swap):
    """SwappedGrads: an fp32 gradient comes back as written; a bf16 one (with its divisor) comes back
    as float(bf16) x (1 / post), as ShardedUnit.materialize_grad computes it; rows read at an offset;
    scales are applied in order; sums of squares add up; inf is reported; clear() forgets all."""
    from zerospeed.offload.grads import SwappedGrads

    store = SwappedGrads(swap)
    g = store.buffer(5000)
    g.copy_(torch.linspace(-1, 1, 5000))
    store.write(0, g, (g.double() ** 2).sum().reshape(1))
    low = store.buffer(3000, torch.bfloat16)
    low.copy_(torch.linspace(-2, 2, 3000))
    want = torch.mul(low.float(), 1.0 / 3.0)
    store.write(1, low, (want.double() ** 2).sum().reshape(1), post=3.0)
    assert torch.equal(store.read(0, 5000), g) and torch.equal(store.read(1, 3000), want)
    part = store.buffer(1000)
    store.read_rows(1, 1024, part).wait()  # element offset 1024: a 2 KiB (bf16) file offset
    assert torch.equal(part, want[1024:2024])
    assert store.read(2, 10) is None and not store.has(2)
    expect = (g.double() ** 2).sum() + (want.double() ** 2).sum()
    assert torch.allclose(store.total_squares(), expect.reshape(1))
    store.scale_(0.5)
    store.scale_(torch.tensor(0.25))
    assert torch.equal(store.apply_scales(part.clone()), part * 0.5 * 0.25)
    bad = store.buffer(10)
    bad.fill_(float("inf"))
    store.write(2, bad, (bad.double() ** 2).sum().reshape(1))
    assert store.nonfinite() == [2]
    store.clear()
    assert not store.has(0) and store.scales == [] and store.inflight_bytes() == 0
