"""ZeRO's per-step host buffers come from a recycled cache, not fresh mappings.

A host tensor above glibc's mmap threshold is a new mapping whose pages the kernel zeroes on first
touch; at width 2048 (ZeRO-3, fp32, world 2) the buffers made afresh every step cost 1.9 GB of page
faults per step (bench/README.md, session 29). On 2 real gloo ranks, every steady ZeRO-3
step must ask the caches (the strategy's `gathered_pool.buffers`, bounded by its own peak, and `.buckets`),
per unit with gradients, for: the reduce-scatter's bucket with its receive workspace, the averaged
`shard.grad`, and the copy of the shard out of the released full buffer (fp32 without a separate master);
from the second step on none is a new allocation. ZeRO-2's chunks take their receive workspace from the
process's cache (`offload.hostmem.recycled`, per byte size as many as were in use at once): at least one
reused per step.
Losses are checked against plain PyTorch by test_zero3.py and test_zero12.py.

The units' full buffers and the nn.Linear weight gradients (session 30): from the second step on, every gather
takes a released unit's memory from the strategy's `GatheredPool` (no new allocation), and the weight
gradients come from `stage3_linear`'s cache (reused); with `memory_efficient_linear` off the losses are the
same bit for bit."""
import zerospeed
from zerospeed.offload.hostmem import recycled
from zerospeed.testing.models import random_tokens, tiny_gpt
from zerospeed.testing.parity import global_batches, train_engine
from zerospeed.testing.spawn import run_distributed

STEPS = 4


def _counts(rank, world, stage, linear=True):
    model = tiny_gpt(seed=0, bias=False)
    zero = {"stage": stage}
    if stage == 3:  # one reduce-scatter per unit; nothing kept gathered between forward and backward
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, reduce_bucket_size=1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": dict(zero, memory_efficient_linear=linear)}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    units = len(engine.strategy.units) if stage == 3 else 0
    per_step = []

    pools = []

    def on_step(_):
        caches = [engine.strategy.gathered_pool.buffers, engine.strategy.gathered_pool.buckets] if stage == 3 \
            else [recycled]  # stage 3: the strategy's own
        per_step.append((sum(c.allocated for c in caches), sum(c.reused for c in caches)))
        if stage == 3:
            s = engine.strategy
            pools.append((s.gathered_pool.allocated, s.gathered_pool.reused) +
                         ((s.linears.cache.allocated, s.linears.cache.reused) if s.linears is not None else ()))
    losses = train_engine(engine, global_batches(random_tokens(2 * world * STEPS, 16, seed=3), 2 * world, STEPS),
                          on_step=on_step)
    engine.destroy()
    return units, per_step, pools, losses


def test_zero3_and_zero2_take_their_per_step_host_buffers_from_the_cache():
    for stage in (3, 2):
        for units, per_step, pools, _ in run_distributed(_counts, 2, stage, timeout=120):
            (a1, r1), (a_last, r_last) = per_step[1], per_step[-1]
            steps = len(per_step) - 2
            asked, reused = (a_last - a1 + r_last - r1) / steps, (r_last - r1) / steps
            if stage == 3:
                assert units == 3  # the root and 2 blocks
                assert asked >= 3 * units, f"stage 3: {asked} host buffers asked for per step, want >= 3 x {units}"
                assert reused == asked, f"stage 3: {asked - reused} new host buffers per step after the first"
            else:
                assert reused >= 1, f"stage 2: {reused} buffers reused per step"
            if stage == 3:  # full buffers and linear weight gradients: nothing new after the first step
                (ga1, gr1, la1, lr1), (ga, gr, la, lr) = pools[0], pools[-1]
                # forward and backward gather each block (the root stays gathered in between)
                assert ga == ga1 and (gr - gr1) / (len(pools) - 1) >= 2 * (units - 1), pools
                # the linears' weight gradients: the previous block's memory serves the next (one block's 4 reused)
                steps = len(pools) - 1
                assert (lr - lr1) / steps >= 4 and (la - la1) / steps < 9, pools


def test_zero3_losses_are_the_same_with_and_without_memory_efficient_linear():
    on = [losses for *_, losses in run_distributed(_counts, 2, 3, True, timeout=120)]
    off = [losses for *_, losses in run_distributed(_counts, 2, 3, False, timeout=120)]
    assert on == off and len(on[0]) == STEPS
