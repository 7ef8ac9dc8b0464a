"""One benchmark run, on every rank (started by `bench_zero.py` through torchrun; not a user entry point).

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/_worker.py \
        --system zerospeed --stage 2 --precision fp32 --model small --steps 6 --warmup 2 \
        --param-groups 2 --data batches.pt --result out.json --launch-time <time.time() before the launch>

Trains `warmup + steps` steps on the pre-sampled batches of its rank, then rank 0 writes one JSON
object: status ("ok" | "not_implemented" | "error"), per-step losses (mean over ranks), per-step
wall times (max over ranks), peak RSS of every rank, model-state bytes of every rank (measured
after the last backward, before its optimizer step), launch-to-first-step seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

_T_PROCESS = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _systems import PARAM_GROUPS, RUNNERS, all_gather_floats, state_total  # noqa: E402

from zerospeed.testing.models import GPT, GPT_SIZES  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True, choices=sorted(RUNNERS))
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--model", choices=sorted(GPT_SIZES), default="small")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--param-groups", type=int, choices=PARAM_GROUPS, default=2,
                   help="2: weight decay 0.1 on ndim >= 2, 0.0 on the rest; 1: one group, weight decay 0.0")
    p.add_argument("--data", required=True, help="batches file written by bench_zero.py")
    p.add_argument("--result", required=True, help="JSON file rank 0 writes")
    p.add_argument("--launch-time", type=float, default=None, help="time.time() when the launcher was started")
    p.add_argument("--profile", default=None, help="write a torch.profiler table of one extra step here (rank 0)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a collective gives up")
    return p.parse_args(argv)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run(args, rank: int, world: int) -> dict:
    rss_start = peak_rss_bytes()  # torch imported, process group up; no model, no data yet
    cfg = GPT_SIZES[args.model]
    batches = torch.load(args.data, weights_only=True)  # uint8 [world, steps, micro, seq + 1]
    if batches.shape[0] < world or batches.shape[1] < args.warmup + args.steps:
        raise ValueError(f"data file {args.data} holds {tuple(batches.shape)}; need {world} ranks x "
                         f"{args.warmup + args.steps} steps")
    # windows are written for the longest model of the invocation: a shorter model reads their first seq_len + 1 bytes
    mine = batches[rank, :args.warmup + args.steps, :args.micro_batch, :cfg.seq_len + 1].long().clone()
    del batches
    torch.manual_seed(args.seed)  # same initial weights on every rank and in every system
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    t_setup = time.perf_counter()
    runner = RUNNERS[args.system](model, stage=args.stage, precision=args.precision,
                                  micro_batch=args.micro_batch, world_size=world, param_groups=args.param_groups)
    setup_s = time.perf_counter() - t_setup

    total = args.warmup + args.steps
    step_s, cpu_s, losses, state, first_step_at = [], [], [], None, None
    for i in range(total):
        x, y = mine[i, :, :-1], mine[i, :, 1:]
        t0, c0 = time.perf_counter(), time.process_time()
        loss = runner.forward_backward(x, y)
        t1, c1 = time.perf_counter(), time.process_time()
        if i == total - 1:
            state = runner.state_bytes()
        t2, c2 = time.perf_counter(), time.process_time()
        runner.step()
        t3, c3 = time.perf_counter(), time.process_time()
        step_s.append((t1 - t0) + (t3 - t2))
        cpu_s.append((c1 - c0) + (c3 - c2))
        losses.append(float(loss.detach().float()))
        if i == 0:
            first_step_at = time.time()

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        x, y = mine[total - 1, :, :-1], mine[total - 1, :, 1:]
        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            runner.forward_backward(x, y)
            runner.step()
        if rank == 0:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            Path(args.profile).write_text(table)

    times = all_gather_floats(step_s)
    cpu_times = all_gather_floats(cpu_s)
    loss_ranks = all_gather_floats(losses)
    launch0 = args.launch_time if args.launch_time is not None else _T_PROCESS
    per_rank = all_gather_floats([peak_rss_bytes(), state_total(state), first_step_at - launch0,
                                  first_step_at - _T_PROCESS, setup_s, rss_start])
    key_lists = [None] * world
    dist.all_gather_object(key_lists, sorted(state))
    state_keys = sorted({k for keys in key_lists for k in keys})
    state_ranks = all_gather_floats([float(state.get(k, 0)) for k in state_keys])
    return {
        "status": "ok",
        "n_params": n_params,
        "step_s": [max(r[i] for r in times) for i in range(total)],
        "cpu_s": [max(r[i] for r in cpu_times) for i in range(total)],
        "losses": [sum(r[i] for r in loss_ranks) / world for i in range(total)],
        "peak_rss_bytes": [r[0] for r in per_rank],
        "start_rss_bytes": [r[5] for r in per_rank],
        "state_bytes": [r[1] for r in per_rank],
        "state_breakdown": [dict(zip(state_keys, r)) for r in state_ranks],
        "launch_to_first_step_s": max(r[2] for r in per_rank),
        "process_to_first_step_s": max(r[3] for r in per_rank),
        "setup_s": max(r[4] for r in per_rank),
        # the groups as the stepping optimizer holds them (DeepSpeed's and zerospeed's re-targeted ones)
        "optimizer_weight_decay": [g.get("weight_decay") for g in runner.optimizer.param_groups],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    meta = {"system": args.system, "stage": args.stage, "precision": args.precision, "model": args.model,
            "world_size": world, "steps": args.steps, "warmup": args.warmup, "micro_batch": args.micro_batch,
            "param_groups": args.param_groups, "seq_len": GPT_SIZES[args.model].seq_len, "torch": torch.__version__}
    if args.system == "zerospeed":
        import zerospeed

        meta["zerospeed_file"] = zerospeed.__file__
    if args.system == "deepspeed":
        import deepspeed

        meta["deepspeed"] = deepspeed.__version__
    try:
        result = run(args, rank, world)
        code = 0
    except NotImplementedError as e:  # a stage / precision this zerospeed does not implement yet
        result = {"status": "not_implemented", "message": str(e)}
        code = 0
    except Exception as e:  # noqa: BLE001 - reported in the table, the benchmark goes on
        result = {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(result["traceback"], file=sys.stderr, flush=True)
        code = 1
    return publish(args.result, rank, meta, result, code)


def publish(path, rank: int, meta: dict, result: dict, code: int) -> int:
    """Rank 0 writes {meta, result} as JSON to `path` (via a temp name); every rank leaves the
    process group. Returns `code` (the worker's exit status)."""
    if rank == 0:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps({**meta, **result}))
        tmp.replace(path)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return code


if __name__ == "__main__":
    sys.exit(main())
