"""The demo training job, run on every rank: a byte-level GPT learns Python's standard library.

    torchrun --nproc-per-node 2 -m zerospeed.demo.train            # config: zerospeed/demo/demo.json

(`zerospeed demo` runs exactly this.) Rank 0 shows a progress bar with the loss, tokens/s and the
resident memory of every rank, reports validation loss in bits per byte every `--eval-interval`
steps against the unigram baseline, samples some text at the end and saves the weights as
safetensors. Ctrl-C (SIGINT) or SIGTERM stops every rank cleanly.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

import zerospeed
from zerospeed.demo.data import load_corpus, nats_to_bits, sample_batch, split_corpus, val_windows
from zerospeed.testing.models import GPT, GPT_SIZES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(Path(__file__).resolve().with_name("demo.json")),
                   help="ds_config JSON file (default: the demo.json shipped with the package)")
    p.add_argument("--model", default="demo", choices=sorted(GPT_SIZES), help="model size (zerospeed.testing.models)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: scheduler total_num_steps)")
    p.add_argument("--eval-interval", type=int, default=100, help="steps between validation passes")
    p.add_argument("--eval-windows", type=int, default=64, help="validation windows (split over ranks)")
    p.add_argument("--val-bytes", type=int, default=None,
                   help="bytes held out at the end of the corpus (default: 1 MiB, at most a tenth of it)")
    p.add_argument("--max-bytes", type=int, default=None, help="use only the first N bytes of the corpus")
    p.add_argument("--sample-bytes", type=int, default=200, help="bytes of text to generate at the end")
    p.add_argument("--out", default="runs/demo", help="directory for the weights and the run summary")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("--wall-clock-breakdown", action="store_true",
                   help="print forward/backward/step times every steps_per_print steps")
    p.add_argument("--csv-log", metavar="DIR", default=None,
                   help="write loss, lr, grad norm, tokens/s and memory per step as CSV files under DIR/demo/")
    args = p.parse_args(argv)
    if args.max_bytes is not None and args.max_bytes < 10_000:
        p.error(f"--max-bytes {args.max_bytes} is too small: use at least 10000")
    if args.val_bytes is not None and args.max_bytes is not None and not 0 < args.val_bytes < args.max_bytes // 2:
        p.error(f"--val-bytes {args.val_bytes} must be between 1 and half of --max-bytes ({args.max_bytes // 2})")
    return args


def load_ds_config(path: str, steps: int | None) -> tuple[dict, int]:
    """The config as a dict, and the number of steps (the override is written into the scheduler)."""
    if not Path(path).is_file():
        raise SystemExit(f"zerospeed demo: config file {path!r} not found ; pass --config PATH")
    with open(path) as f:
        cfg = json.load(f)
    sched = cfg.get("scheduler", {}).get("params", {})
    total = steps or sched.get("total_num_steps")
    if total is None:
        raise SystemExit("zerospeed demo: pass --steps or set scheduler.params.total_num_steps in the config")
    if "total_num_steps" in sched:
        sched["total_num_steps"] = total
        sched["warmup_num_steps"] = min(sched.get("warmup_num_steps", 0), max(total // 10, 1))
    return cfg, total


@torch.no_grad()
def evaluate(engine, val: torch.Tensor, seq_len: int, num: int, batch: int) -> float:
    """Mean validation loss in bits per byte over `num` fixed windows, split across the ranks."""
    engine.eval()
    x, y = val_windows(val, seq_len, num)
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(rank * batch, num, world * batch):
        xb, yb = x[i:i + batch].to(engine.device), y[i:i + batch].to(engine.device)
        total[0] += float(engine(xb, yb)) * xb.shape[0]
        total[1] += xb.shape[0]
    dist.all_reduce(total)
    engine.train()
    return nats_to_bits(float(total[0] / total[1]))


def rss_per_rank() -> list[float]:
    """Resident set size of every rank, GiB (a collective)."""
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    t[dist.get_rank()] = psutil.Process().memory_info().rss / 2**30
    dist.all_reduce(t)
    return t.tolist()


class Stop(Exception):
    """Raised by the signal handler so every rank leaves the loop cleanly."""


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def on_signal(signum, frame):
        raise Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    ds_config, total_steps = load_ds_config(args.config, args.steps)
    if args.wall_clock_breakdown:
        ds_config["wall_clock_breakdown"] = True
    if args.csv_log:
        ds_config["csv_monitor"] = {"enabled": True, "output_path": args.csv_log, "job_name": "demo"}
    torch.manual_seed(args.seed)
    model = GPT(GPT_SIZES[args.model])
    engine, _, _, _ = zerospeed.initialize(model=model, config=ds_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    seq_len = model.cfg.seq_len
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()

    corpus = load_corpus(max_bytes=args.max_bytes)
    splits = split_corpus(corpus, args.val_bytes or min(1 << 20, corpus.numel() // 10))
    unigram = splits.unigram_bits_per_byte()
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank reads different windows
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"zerospeed demo: {n_params / 1e6:.2f}M-parameter GPT, {world} ranks, micro-batch {micro} x "
              f"grad-accum {gas} x seq {seq_len}; {splits.train.numel() / 1e6:.1f} MB of stdlib source, "
              f"unigram baseline {unigram:.3f} bits/byte", flush=True)

    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, file=sys.stdout)
    tokens_per_step = engine.train_batch_size() * seq_len
    history, val_bits, t0, interrupted = [], None, time.perf_counter(), None
    t_last, loss_avg = t0, None
    try:
        for step in range(1, total_steps + 1):
            loss_sum = 0.0
            for _ in range(gas):
                x, y = sample_batch(splits.train, micro, seq_len, gen)
                loss = engine(x.to(engine.device), y.to(engine.device))
                engine.backward(loss)
                engine.step()
                loss_sum += loss.item() / gas
            loss_avg = loss_sum if loss_avg is None else 0.9 * loss_avg + 0.1 * loss_sum
            if step % 10 == 0 or step == total_steps:
                mem = rss_per_rank()
                now = time.perf_counter()
                tok_s = tokens_per_step * (10 if step % 10 == 0 else step % 10) / (now - t_last)
                t_last = now
                stats = {"step": step, "loss_bits": nats_to_bits(loss_avg), "tok_s": tok_s, "rss_gib": mem}
                history.append(stats)
                if bar is not None:
                    bar.set_postfix_str(f"loss {nats_to_bits(loss_avg):.3f} b/B | {tok_s:,.0f} tok/s | RSS "
                                        + "/".join(f"{m:.2f}" for m in mem) + " GiB")
            if step % args.eval_interval == 0 or step == total_steps:
                val_bits = evaluate(engine, splits.val, seq_len, args.eval_windows, micro)
                if rank == 0:
                    msg = f"step {step}: validation {val_bits:.3f} bits/byte (unigram {unigram:.3f})"
                    bar.write(msg) if bar is not None else print(msg, flush=True)
            if bar is not None:
                bar.update(1)
            elif rank == 0 and step % 10 == 0:
                s = history[-1]
                print(f"step {step}/{total_steps} loss {s['loss_bits']:.3f} bits/byte {s['tok_s']:,.0f} tok/s",
                      flush=True)
    except Stop as exc:
        interrupted = str(exc)
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0
    if interrupted:
        if rank == 0:
            print(f"zerospeed demo: stopped by {interrupted} after {engine.global_steps} steps; nothing saved",
                  flush=True)
        engine.destroy()
        dist.destroy_process_group()
        return 130

    out = Path(args.out)
    if rank == 0:
        from safetensors.torch import save_file

        from zerospeed.utils.io import atomic_write

        out.mkdir(parents=True, exist_ok=True)
        weights = out / "model.safetensors"
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
                 if k != "lm_head.weight" or not model.cfg.tie_weights}
        atomic_write(weights, lambda tmp: save_file(state, str(tmp), metadata={"model": args.model}))
        prompt = b"def "
        gen_s = torch.Generator().manual_seed(0)
        model.eval()
        ids = torch.tensor([list(prompt)], device=engine.device)
        sample = model.generate(ids, args.sample_bytes, temperature=0.8, top_k=20, generator=gen_s)
        text = bytes(sample[0].tolist()).decode("utf-8", errors="replace")
        tok_s = sum(h["tok_s"] for h in history[1:]) / max(len(history) - 1, 1) if history else 0.0
        summary = {"steps": total_steps, "wall_s": round(wall, 1), "val_bits_per_byte": round(val_bits, 4),
                   "unigram_bits_per_byte": round(unigram, 4), "tokens_per_s": round(tok_s),
                   "world_size": world, "params": n_params, "weights": str(weights)}
        atomic_write(out / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=1)))
        print("\n--- sample ---\n" + text + "\n--------------")
        print(f"zerospeed demo: {total_steps} steps in {wall:.0f} s, {tok_s:,.0f} tokens/s; validation "
              f"{val_bits:.3f} bits/byte vs unigram {unigram:.3f}; weights saved to {weights}", flush=True)
    engine.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
