"""Checkpoint save / load times and on-disk size, and `zerospeed to-fp32` time and peak RAM.

    python bench/bench_checkpoint.py                      # GPT_SIZES["demo"], 2 ranks, stages 0-3, fp32
    python bench/bench_checkpoint.py --model small --stages 3 --repeats 3

For each stage: 2 training steps (so Adam's states exist), then `repeats` x save_checkpoint and
load_checkpoint into a fresh engine (medians; wall time on rank 0 between barriers, fsync included),
the size of the tag directory, and the bytes per parameter. Then `zerospeed to-fp32` of the last
checkpoint in a subprocess: wall time and peak RSS growth over the imports, against the checkpoint
and largest-tensor sizes.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zerospeed
from zerospeed.testing.models import GPT, GPT_SIZES, random_tokens
from zerospeed.testing.parity import global_batches, train_engine
from zerospeed.testing.spawn import run_distributed


def _config(stage):
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def body(rank, world, model_name, stage, root, repeats):
    cfg = GPT_SIZES[model_name]
    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(model=GPT(cfg), config=_config(stage))
    train_engine(engine, global_batches(random_tokens(2 * world * 2, cfg.seq_len, seed=1), 2 * world, 2))
    saves, loads = [], []
    for i in range(repeats):
        saves.append(_timed(lambda: engine.save_checkpoint(root, tag=f"s{stage}-{i}")))
    fresh, *_ = zerospeed.initialize(model=GPT(cfg), config=_config(stage))
    for i in range(repeats):
        loads.append(_timed(lambda: fresh.load_checkpoint(root, tag=f"s{stage}-{i}")))
    params = sum(p.numel() for p in GPT(cfg).parameters())
    return statistics.median(saves), statistics.median(loads), params


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo", choices=sorted(GPT_SIZES))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--repeats", type=int, default=3)
    ns = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="zs-bench-ckpt-"))
    print(f"model {ns.model}, {ns.world} ranks, fp32 + AdamW, checkpoints in {root}")
    print(f"{'stage':>5} {'params':>10} {'save s':>8} {'load s':>8} {'size MB':>8} {'B/param':>8}")
    for stage in map(int, ns.stages.split(",")):
        save, load, params = run_distributed(body, ns.world, ns.model, stage, str(root), ns.repeats, timeout=600)[0]
        tag = root / f"s{stage}-0"
        size = sum(f.stat().st_size for f in tag.iterdir())
        print(f"{stage:>5} {params:>10} {save:>8.3f} {load:>8.3f} {size / 1e6:>8.2f} {size / params:>8.2f}")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "zerospeed.cli", "to-fp32", str(root), str(root / "fp32"),
                           "--tag", tag.name], capture_output=True, text=True)
    cfg = GPT_SIZES[ns.model]
    largest = 4 * max(cfg.vocab_size * cfg.d_model, 4 * cfg.d_model * cfg.d_model)
    print(f"to-fp32: {proc.stdout.strip() or proc.stderr.strip()} (subprocess {time.perf_counter() - start:.1f} s; "
          f"checkpoint {size / 1e6:.1f} MB, largest tensor {largest / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
