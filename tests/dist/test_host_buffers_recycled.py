"""ZeRO's per-step host buffers come from the recycled cache (`offload.hostmem.recycled`), not fresh mappings.

A host tensor above glibc's mmap threshold is a new mapping whose pages the kernel zeroes on first
touch; at width 2048 (ZeRO-3, fp32, world 2) the buffers made afresh every step cost 1.9 GB of page
faults per step (bench/README.md, session 29). On 2 real gloo ranks, every steady ZeRO-3 step must ask the
cache, per unit with gradients, for: the reduce-scatter's bucket with its receive workspace, the averaged
`shard.grad`, and the copy of the shard out of the released full buffer (fp32 without a separate master);
before this change only the bucket came from it. The cache keeps one free storage per byte size, so equal
units alive at once still allocate: at least one buffer per unit must be a reused one. ZeRO-2's chunks take
their receive workspace from the cache too. Losses are checked against plain PyTorch by test_zero3.py and
test_zero12.py."""
import zerospeed
from zerospeed.offload.hostmem import recycled
from zerospeed.testing.models import random_tokens, tiny_gpt
from zerospeed.testing.parity import global_batches, train_engine
from zerospeed.testing.spawn import run_distributed

STEPS = 4


def _counts(rank, world, stage):
    model = tiny_gpt(seed=0, bias=False)
    zero = {"stage": stage}
    if stage == 3:  # one reduce-scatter per unit; nothing kept gathered between forward and backward
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, reduce_bucket_size=1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": zero}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    units = len(engine.strategy.units) if stage == 3 else 0
    per_step = []

    def on_step(_):
        per_step.append((recycled.allocated, recycled.reused))
    train_engine(engine, global_batches(random_tokens(2 * world * STEPS, 16, seed=3), 2 * world, STEPS),
                 on_step=on_step)
    engine.destroy()
    return units, per_step


def test_zero3_and_zero2_take_their_per_step_host_buffers_from_the_cache():
    for stage in (3, 2):
        for units, per_step in run_distributed(_counts, 2, stage, timeout=120):
            (a1, r1), (a_last, r_last) = per_step[1], per_step[-1]
            steps = len(per_step) - 2
            asked, reused = (a_last - a1 + r_last - r1) / steps, (r_last - r1) / steps
            if stage == 3:
                assert units == 3  # the root and 2 blocks
                assert asked >= 3 * units, f"stage 3: {asked} host buffers asked for per step, want >= 3 x {units}"
                assert reused >= units, f"stage 3: {reused} host buffers reused per step, want >= {units}"
            else:
                assert reused >= 1, f"stage 2: {reused} buffers reused per step"
