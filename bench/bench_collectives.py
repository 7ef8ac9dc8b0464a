"""gloo collectives as zerospeed runs them against torch's own: milliseconds per call, in one run.

    python bench/bench_collectives.py                  # world 2 and 4, 1M-10.8M fp32 elements
    python bench/bench_collectives.py --worlds 2 --sizes 10844160 --repeats 15

For each world size one torchrun launch (gloo, 1 thread per rank) times, per size, median over
`--repeats` calls (a barrier before each, the slowest rank's time is not taken: rank 0's is, the
collectives end together), interleaved:
- all-gather: `dist.all_gather_into_tensor` (torch) against `zerospeed.comm.ops.start_all_gather`
  (on gloo: point-to-point messages, one isend/irecv per other rank), in place (input = own slice of
  output), and the one in-place broadcast per source rank that zerospeed ran before;
- reduce-scatter: `dist.reduce_scatter_tensor` (torch; on gloo a clone + all-reduce + copy) and
  `dist.reduce_scatter` (list of N inputs) against `start_reduce_scatter(..., input_is_scratch=True)`
  (on gloo point-to-point messages into an [(N-1)k] buffer + a local sum), the all-to-all into an
  [N*k] buffer + sum it replaced, and a plain in-place `dist.all_reduce` of the same buffer (what
  zerospeed ran before eed0c0d) for reference.
Prints a markdown table; the numbers behind the choices in `comm/ops.py` (bench/README.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SIZES = (1_000_000, 2_700_000, 6_500_000, 10_844_160)  # 10,844,160 = the small GPT's Ψ


def _all_to_all_sum(flat, own, world) -> None:
    import torch
    import torch.distributed as dist

    received = torch.empty_like(flat)
    dist.all_to_all_single(received, flat)
    pieces = received.view(world, -1)
    torch.add(pieces[0], pieces[1], out=own)
    for piece in pieces[2:]:
        own.add_(piece)


def _worker(sizes: list[int], repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from zerospeed.comm.ops import start_all_gather, start_reduce_scatter

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for numel in sizes:
        numel -= numel % world
        k = numel // world
        flat = torch.randn(numel)
        out = torch.empty(k)
        own = flat[rank * k:(rank + 1) * k]
        cases = {
            "all-gather: torch all_gather_into_tensor": lambda: dist.all_gather_into_tensor(flat, own),
            "all-gather: zerospeed start_all_gather": lambda: start_all_gather(flat, own, group=None).wait(),
            "(all-gather: N broadcasts)": lambda: [w.wait() for w in [
                dist.broadcast(flat[i * k:(i + 1) * k], src=i, async_op=True) for i in range(world)]],
            "reduce-scatter: torch reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, flat),
            "reduce-scatter: zerospeed, input_is_scratch": lambda: start_reduce_scatter(
                own, flat, group=None, input_is_scratch=True).wait(),
            "(reduce-scatter: all-to-all + sum)": lambda: _all_to_all_sum(flat, own, world),
            "reduce-scatter: torch reduce_scatter (list)": lambda: dist.reduce_scatter(out, list(flat.chunk(world))),
            "(all-reduce, in place)": lambda: dist.all_reduce(flat),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeats):
            for name, fn in cases.items():  # interleaved: each repeat runs every case once
                dist.barrier()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        rows.append((numel, {name: statistics.median(ts) * 1e3 for name, ts in times.items()}))
    if rank == 0:
        names = list(rows[0][1])
        print(f"\nworld size {world} (gloo, 1 thread per rank), ms per call, median of {repeats}\n")
        print("| case | " + " | ".join(f"{n:,} elements" for n, _ in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for name in names:
            print(f"| {name} | " + " | ".join(f"{r[name]:.1f}" for _, r in rows) + " |")
        for a, b in (("all-gather: torch all_gather_into_tensor", "all-gather: zerospeed start_all_gather"),
                     ("reduce-scatter: torch reduce_scatter_tensor", "reduce-scatter: zerospeed, input_is_scratch")):
            print(f"| {b.split(':')[0]}: torch / zerospeed | "
                  + " | ".join(f"{r[a] / r[b]:.2f}x" for _, r in rows) + " |")
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (one launch each)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated fp32 element counts")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        _worker(sizes, args.repeats)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for world in (int(w) for w in args.worlds.split(",")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               __file__, "--worker", "--sizes", args.sizes, "--repeats", str(args.repeats)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(res.stdout, end="")
        if res.returncode != 0:
            sys.exit(f"world size {world} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")


if __name__ == "__main__":
    main()
