"""ZeRO-Offload / ZeRO-Infinity: zerospeed against DeepSpeed, in-memory vs host vs NVMe, in one run.

    python bench/bench_offload.py                       # base (3 modes) + a big model (NVMe), see bench/README.md
    python bench/bench_offload.py --models base --modes mem,nvme --repeats 2
    python bench/bench_offload.py --report bench/results/bench_offload_<timestamp>.json
    python bench/bench_offload.py --largest             # 1B / 2B / 4B GPTs, bf16 and fp32, NVMe (bench/_largest.py)

ZeRO stage 3, fp32, AdamW (bench/_systems.py), world size 2 (gloo, 1 thread per rank), the demo's
text as pre-sampled windows (bench_zero.write_batches: same bytes for every system), the same seed
and initial weights in both systems. Modes: mem (no offload), cpu (offload_optimizer + offload_param
device cpu), nvme (both device nvme, the same nvme_path, aio block and buffer sizes in both systems).
Each (model, system, mode, repeat) is its own torchrun launch of bench/_offload_worker.py (repeats
interleaved, medians reported); each launch gets its own swap directory, removed after it (the
bytes an engine left behind are reported). Before the launches, the raw sequential bandwidth of the
disk holding --nvme-path is measured: `dd` with O_DIRECT (1 MiB blocks) and zerospeed's AsyncIO with
one worker and with 8. Writes <out>/bench_offload_<timestamp>.{md,json} and logs_<timestamp>/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _largest  # noqa: E402
from bench_zero import _log_tail, launch, write_batches  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
MODES = ("mem", "cpu", "nvme")
MODE_LABEL = {"mem": "in-memory", "cpu": "host (cpu) offload", "nvme": "NVMe offload"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="zerospeed,deepspeed")
    p.add_argument("--modes", default="mem,cpu,nvme", help="modes for the base model")
    p.add_argument("--models", default="base,big:16x1536",
                   help="base and/or big:LAYERSxWIDTH (InitGPT built under zero.Init; default 16 x 1536 = 0.45B); "
                        "a '=mem/nvme' suffix runs that model in those modes only (instead of --modes/--big-modes)")
    p.add_argument("--big-modes", default="nvme", help="modes for the big model(s)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (base)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (base; >= 2: step 2 reads the states back)")
    p.add_argument("--big-steps", type=int, default=2)
    p.add_argument("--big-warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--nvme-path", default=str(HERE / "results" / "swap"))
    p.add_argument("--raw-gib", type=float, default=1.0, help="size of the raw-bandwidth test file")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per launch")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--report", metavar="JSON", default=None, help="only re-render a saved run")
    p.add_argument("--aio-threads", type=int, default=1, help="aio.thread_count of the NVMe runs (both systems)")
    p.add_argument("--largest", action="store_true",
                   help=f"issue 22's run: zerospeed on --models {_largest.MODELS} (NVMe, checkpointing; _largest.py)")
    p.add_argument("--add-runs", metavar="JSON", nargs="*", default=[],
                   help="per-launch result files of an earlier invocation to report with this one (marked in the "
                        "JSON; their load and raw bandwidth are not this run's)")
    return p.parse_args(argv)


# -- raw disk bandwidth -------------------------------------------------------------------------------
def _dd(args: list[str]) -> float:
    """MB/s (1e6 bytes) dd reports."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    return int(m.group(1)) / float(m.group(2)) / 1e6


def _dd_parallel(arg_lists: list[list[str]]) -> float:
    """Aggregate MB/s of dd processes run at the same time: their bytes over the wall time of all."""
    t = time.perf_counter()
    procs = [subprocess.Popen(["dd", *a], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for a in arg_lists]
    moved = 0
    for p in procs:
        err = p.communicate()[1]
        if p.returncode:
            raise subprocess.CalledProcessError(p.returncode, p.args, stderr=err)
        moved += int(re.search(r"(\d+) bytes .* copied", err).group(1))
    return moved / (time.perf_counter() - t) / 1e6


def raw_bandwidth(path: Path, gib: float, streams: int = 2) -> dict:
    """Sequential O_DIRECT write then read of a `gib` GiB file in `path`: dd (bs=1M, one stream), `streams`
    dd processes at once on their own files (aggregate: the disk as the ranks share it), and zerospeed's
    AsyncIO (1 MiB pieces, 1 worker thread vs 8). MB/s; the files are removed."""
    import torch

    from zerospeed.offload.aio import AsyncIO, aligned_empty

    path.mkdir(parents=True, exist_ok=True)
    f = path / "raw_bandwidth.bin"
    count = int(gib * 1024)
    out = {"bytes": count * MiB}
    try:
        out["dd_write"] = _dd(["if=/dev/zero", f"of={f}", "bs=1M", f"count={count}", "oflag=direct", "conv=fsync"])
        out["dd_read"] = _dd([f"if={f}", "of=/dev/null", "bs=1M", "iflag=direct"])
        files = [path / f"raw_bandwidth_{i}.bin" for i in range(streams)]
        try:
            out["ddN_write"] = _dd_parallel([["if=/dev/zero", f"of={g}", "bs=1M", f"count={count}", "oflag=direct",
                                              "conv=fsync"] for g in files])
            out["ddN_read"] = _dd_parallel([[f"if={g}", "of=/dev/null", "bs=1M", "iflag=direct"] for g in files])
        finally:
            for g in files:
                g.unlink(missing_ok=True)
        out["streams"] = streams
        buf = aligned_empty(count * MiB // 4, torch.float32)
        buf.fill_(1.0)
        for name, qd in (("aio1", 1), ("aio8", 8)):
            io = AsyncIO(block_size=MiB, queue_depth=qd, thread_count=1, use_direct=True)
            f.unlink()
            t = time.perf_counter()
            io.write(f, buf)
            out[f"{name}_write"] = buf.numel() * 4 / (time.perf_counter() - t) / 1e6
            t = time.perf_counter()
            io.read(f, buf)
            out[f"{name}_read"] = buf.numel() * 4 / (time.perf_counter() - t) / 1e6
            io.close()
    finally:
        f.unlink(missing_ok=True)
    for kind in ("read", "write"):
        out[f"best_{kind}"] = max(out[f"{k}_{kind}"] for k in ("dd", "ddN", "aio1", "aio8"))
    return out


def deepspeed_nvme_ready() -> str | None:
    """None if DeepSpeed's async_io op can be used (libaio present), else the reason it cannot."""
    try:
        env = dict(os.environ, DS_ACCELERATOR="cpu")
        code = "from deepspeed.ops.op_builder import AsyncIOBuilder as B; b = B(); import sys; " \
               "sys.exit(0 if b.is_compatible(False) else 3); "
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"deepspeed check failed: {e}"
    if r.returncode == 3:
        return "DeepSpeed's async_io op is not compatible here (libaio-dev missing: apt-get install -y libaio-dev)"
    return None if r.returncode == 0 else f"deepspeed not importable: {_first_line(r.stderr)}"


def _first_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if "Error" in ln] or text.splitlines()[-1:] or [""]
    return lines[-1][:200]


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.exists() else 0


# -- runs ---------------------------------------------------------------------------------------------
def plan(args) -> list[tuple[str, str, str]]:
    systems, out = args.systems.split(","), []
    for key in args.models.split(","):
        model, _, only = key.partition("=")  # 'big:12x2560=mem': this model in these modes only
        modes = only or (args.modes if model == "base" else args.big_modes)
        out += [(model, s, m) for m in modes.split("/" if only else ",") for s in systems]
    return out


def run_all(args, stamp: str, logs: Path, data: Path, ds_skip: str | None) -> list[dict]:
    runs, configs = [], plan(args)
    nvme_root = Path(args.nvme_path)
    n = len(configs) * args.repeats
    for rep in range(args.repeats):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)] if args.repeats > 1 else configs
        for model, system, mode in order:
            row = {"model": model, "system": system, "mode": mode, "repeat": rep}
            if system == "deepspeed" and mode == "nvme" and ds_skip:
                print(f"skip: DeepSpeed NVMe offload: {ds_skip}", file=sys.stderr, flush=True)
                runs.append({**row, "status": "skipped", "message": ds_skip})
                continue
            big = model != "base"
            if args.largest and (need := _largest.disk_need(model)) > 0.97 * shutil.disk_usage(nvme_root).free:
                why = (f"does not fit the disk: its swap files take {need / 1e9:.1f} GB (offload.budget), "
                       f"{shutil.disk_usage(nvme_root).free / 1e9:.1f} GB free")
                print(f"skip {model}: {why}", file=sys.stderr, flush=True)
                runs.append({**row, "status": "skipped", "message": why})
                continue
            name = f"{model.replace(':', '')}_{system}_{mode}_r{rep}"
            swap = nvme_root / f"{stamp}_{name}"
            swap.mkdir(parents=True, exist_ok=True)
            result = data.parent / f"{name}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(HERE / "_offload_worker.py"), "--system", system, "--mode", mode, "--model", model,
                   "--steps", str(args.big_steps if big else args.steps),
                   "--warmup", str(args.big_warmup if big else args.warmup),
                   "--micro-batch", str(args.micro_batch), "--seed", str(args.seed),
                   "--nvme-path", str(swap), "--data", str(data), "--result", str(result)]
            cmd += (_largest.WORKER_FLAGS if args.largest else []) + ["--aio-threads", str(args.aio_threads)]
            load = os.getloadavg()[0]
            code, wall = launch(cmd, logs / f"{name}.log", args.timeout)
            left = _dir_bytes(swap)
            shutil.rmtree(swap, ignore_errors=True)
            if result.exists():
                run = {**json.loads(result.read_text()), **row}
            else:
                why = "timed out" if code is None else f"exit code {code}"
                run = {**row, "status": "error", "message": f"{why}: {_log_tail(logs / f'{name}.log')}"}
            run.update(load_avg_1min=load, load_avg_end=os.getloadavg()[0], launch_s=wall, swap_left_bytes=left)
            runs.append(run)
            k = len(runs)
            what = (f"step {statistics.median(run['step_s'][run['warmup']:]):.2f} s, peak RSS "
                    f"{max(run['peak_rss_bytes']) / MiB:,.0f} MiB" if run["status"] == "ok"
                    else f"{run['status']}: {run.get('message', '')[:160]}")
            print(f"[{k}/{n}] {system} {mode} {model}: {what} ({wall:.0f} s, load {load:.1f}, "
                  f"swap left {left / MiB:.0f} MiB)", file=sys.stderr, flush=True)
    return runs


# -- report -------------------------------------------------------------------------------------------
def _med(xs):
    return statistics.median(xs) if xs else None


def aggregate(runs: list[dict]) -> dict:
    """(model, system, mode) -> medians over repeats of the per-run numbers."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["model"], r["system"], r["mode"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        if not ok:
            out[key] = {"status": rs[0]["status"], "message": rs[0].get("message", "")}
            continue
        per = []
        for r in ok:
            timed, cpu = r["step_s"][r["warmup"]:], r["cpu_s"][r["warmup"]:]
            step, nsteps = _med(timed), len(timed)
            io = r["io"]
            rd = sum(x["disk_read"] for x in io) / len(io) / nsteps
            wr = sum(x["disk_written"] for x in io) / len(io) / nsteps
            d = {"step_s": step, "cpu_s": _med(cpu), "peak_rss": max(r["peak_rss_bytes"]),
                 "start_rss": max(r["start_rss_bytes"]), "n_params": r["n_params"], "read_per_step": rd,
                 "written_per_step": wr, "swap_left": r["swap_left_bytes"], "load": r["load_avg_1min"],
                 "io_rate": (rd + wr) / sum(timed) * nsteps, "losses": r["losses"]}
            if r.get("has_aio_counters"):
                d["busy_frac"] = _med([x["aio_busy_s"] / sum(timed) for x in io])
                d["wait_frac"] = _med([x.get("aio_wait_s", 0.0) / sum(timed) for x in io])
                # per rank: bytes / time with at least one request of that kind in flight; the two ranks'
                # I/O runs concurrently (the steps are synchronised by collectives), so node = sum of ranks
                d["aio_read_bw"] = sum(x["aio_read"] / x["aio_busy_read_s"] for x in io if x["aio_busy_read_s"])
                d["aio_write_bw"] = sum(x["aio_written"] / x["aio_busy_write_s"] for x in io
                                        if x["aio_busy_write_s"])
                d["aio_rank_read_bw"] = _med([x["aio_read"] / x["aio_busy_read_s"] for x in io if x["aio_busy_read_s"]])
                d["aio_rank_write_bw"] = _med([x["aio_written"] / x["aio_busy_write_s"] for x in io
                                               if x["aio_busy_write_s"]])
            per.append(d)
        agg = {k: _med([d[k] for d in per if d.get(k) is not None]) for k in per[0] if k != "losses"}
        agg.update(status="ok", repeats=len(per), losses=per[0]["losses"])
        out[key] = agg
    return out


def largest_trainable(agg: dict, mem_total: int, disk_free: int) -> dict:
    """Largest Ψ whose zerospeed NVMe run fits 2 ranks in RAM and 16Ψ bytes in the free disk; and the
    largest Ψ an in-memory run fits. Per-rank RSS is modelled as start + k·Ψ: k from two NVMe sizes
    when both ran, else (peak - start)/Ψ of the one (an over-estimate of k: it includes fixed buffers)."""
    def line(mode):
        pts = sorted((v["n_params"], v["peak_rss"], v["start_rss"]) for (m, s, md), v in agg.items()
                     if s == "zerospeed" and md == mode and v["status"] == "ok")
        if not pts:
            return None
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            k = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
            c = pts[-1][1] - k * pts[-1][0]
        else:
            psi, peak, start = pts[-1]
            k, c = (peak - start) / psi, start
        return k, c
    out = {"mem_total": mem_total, "disk_free": disk_free}
    nv, mem = line("nvme"), line("mem")
    if nv:
        out["nvme_bytes_per_param_rank"], out["nvme_fixed_rank"] = nv
        out["nvme_ram_limit"] = (mem_total / 2 - nv[1]) / nv[0]
        out["nvme_disk_limit"] = disk_free / 16
        out["nvme_largest"] = min(out["nvme_ram_limit"], out["nvme_disk_limit"])
    if mem:
        out["mem_bytes_per_param_rank"], out["mem_fixed_rank"] = mem
        out["mem_largest"] = (mem_total / 2 - mem[1]) / mem[0]
    if nv and mem:
        out["ratio"] = out["nvme_largest"] / out["mem_largest"]
    return out


def _mb(x):
    return "—" if x is None else f"{x / 1e6:,.0f}"


def markdown(saved: dict) -> str:
    agg = {tuple(k.split("|")): v for k, v in saved["agg"].items()}
    raw, lines = saved["raw"], []
    lines.append(f"bench_offload {saved['stamp']}: ZeRO-3 fp32 AdamW, world size 2 (gloo, 1 thread/rank), micro-batch "
                 f"{saved['args']['micro_batch']} x seq {saved['args']['seq']}; load avg "
                 f"{min(saved['loads']):.1f}-{max(saved['loads']):.1f}; {saved['machine']}")
    lines.append("")
    lines.append(f"Raw sequential O_DIRECT bandwidth of {saved['args']['nvme_path']} ({raw['bytes'] / GiB:.1f} GiB file), "
                 f"MB/s read / write: dd bs=1M {raw['dd_read']:,.0f} / {raw['dd_write']:,.0f}; AsyncIO 1 worker "
                 f"{raw['aio1_read']:,.0f} / {raw['aio1_write']:,.0f}; AsyncIO 8 workers {raw['aio8_read']:,.0f} / "
                 f"{raw['aio8_write']:,.0f}. Compared against: the best of these, {raw['best_read']:,.0f} / "
                 f"{raw['best_write']:,.0f}.")
    lines.append("")
    lines.append("| model (params) | system | mode | step s wall / CPU | zerospeed/DeepSpeed step time | peak RSS/rank MiB "
                 "(growth) | disk read / written per step per rank, MB | achieved I/O MB/s read / write (% of raw) | "
                 "I/O in flight / training thread waiting on I/O, % of step | swap left |")
    lines.append("|" + "---|" * 10)
    for model in dict.fromkeys(k[0] for k in agg):
        for mode in MODES:
            for system in ("zerospeed", "deepspeed"):
                v = agg.get((model, system, mode))
                if v is None:
                    continue
                label = f"{model} ({v['n_params'] / 1e6:,.0f}M)" if v.get("n_params") else model
                if v["status"] != "ok":
                    lines.append(f"| {label} | {system} | {MODE_LABEL[mode]} | {v['status']}: {v['message'][:200]} "
                                 "| | | | | | |")
                    continue
                other = agg.get((model, "deepspeed", mode))
                ratio = f"{v['step_s'] / other['step_s']:.2f}x" if system == "zerospeed" and other and \
                    other.get("status") == "ok" else "—"
                if "aio_read_bw" in v:
                    bw = (f"{v['aio_read_bw'] / 1e6:,.0f} / {v['aio_write_bw'] / 1e6:,.0f} "
                          f"({100 * v['aio_read_bw'] / 1e6 / raw['best_read']:.0f}% / "
                          f"{100 * v['aio_write_bw'] / 1e6 / raw['best_write']:.0f}%)")
                    busy = f"{100 * v['busy_frac']:.0f}% / {100 * v['wait_frac']:.0f}%"
                elif mode == "nvme":
                    bw, busy = f"n/a (counters not accessible; disk bytes / step time {_mb(v['io_rate'])})", "n/a"
                else:
                    bw, busy = "—", "—"
                io = f"{_mb(v['read_per_step'])} / {_mb(v['written_per_step'])}" if mode == "nvme" else "—"
                lines.append(f"| {label} | {system} | {MODE_LABEL[mode]} | {v['step_s']:.2f} / {v['cpu_s']:.2f} | {ratio} "
                             f"| {v['peak_rss'] / MiB:,.0f} (+{(v['peak_rss'] - v['start_rss']) / MiB:,.0f}) | {io} | {bw} "
                             f"| {busy} | {v['swap_left'] / MiB:,.0f} MiB |")
    lt = saved["largest"]
    lines.append("")
    if "nvme_largest" in lt:
        lines.append(f"Largest trainable (zerospeed, both tiers on NVMe, computed): per-rank RSS = "
                     f"{lt['nvme_fixed_rank'] / MiB:,.0f} MiB + {lt['nvme_bytes_per_param_rank']:.2f} B x Ψ (fit over the "
                     f"NVMe runs); RAM {lt['mem_total'] / GiB:.1f} GiB / 2 ranks -> Ψ <= {lt['nvme_ram_limit'] / 1e9:.2f}B; "
                     f"disk {lt['disk_free'] / 1e9:.0f} GB free / 16 B -> Ψ <= {lt['nvme_disk_limit'] / 1e9:.2f}B; "
                     f"largest = **{lt['nvme_largest'] / 1e9:.2f}B parameters**.")
    if "mem_largest" in lt:
        lines.append(f"In memory (stage 3, no offload): {lt['mem_fixed_rank'] / MiB:,.0f} MiB + "
                     f"{lt['mem_bytes_per_param_rank']:.2f} B x Ψ per rank -> Ψ <= {lt['mem_largest'] / 1e9:.2f}B"
                     + (f"; NVMe / in-memory = **{lt['ratio']:.1f}x**." if "ratio" in lt else "."))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.largest:
        if args.models == parse_args([]).models:
            args.models = _largest.MODELS
        if args.systems == parse_args([]).systems:  # '--systems deepspeed': DeepSpeed's NVMe offload, same models
            args.systems = "zerospeed"  # --big-modes mem: the same model in memory (the compute floor, if it fits)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print(_largest.markdown(saved) if saved["args"].get("largest") else markdown(saved))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d_%H%M%S")
    logs = out / f"logs_{stamp}"
    logs.mkdir()
    nvme_root = Path(args.nvme_path)
    nvme_root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    disk_free = shutil.disk_usage(nvme_root).free
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"bench_offload: raw bandwidth of {nvme_root} ...", file=sys.stderr, flush=True)
    raw = raw_bandwidth(nvme_root, args.raw_gib)
    print(f"  {json.dumps({k: round(v) for k, v in raw.items()})}", file=sys.stderr, flush=True)
    ds_skip = deepspeed_nvme_ready() if "deepspeed" in args.systems else None
    if ds_skip:
        print(f"skip: DeepSpeed NVMe rows: {ds_skip}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_offload_") as tmp:
        data = Path(tmp) / "batches.pt"
        write_batches(data, world=2, steps=max(args.steps + args.warmup, args.big_steps + args.big_warmup),
                      micro=args.micro_batch, seq_len=args.seq, seed=args.seed)
        runs = run_all(args, stamp, logs, data, ds_skip)
    for f in args.add_runs:
        r = json.loads(Path(f).read_text())
        runs.append({**r, "repeat": 0, "added_from": f, "load_avg_1min": r.get("load_avg_1min", float("nan")),
                     "swap_left_bytes": r.get("swap_left_bytes", 0)})
    agg = aggregate(runs)
    saved = {"stamp": stamp, "args": vars(args), "raw": raw, "runs": runs, "minutes": (time.time() - t0) / 60,
             "agg": {"|".join(k): v for k, v in agg.items()},
             "loads": [r["load_avg_1min"] for r in runs if "added_from" not in r] or [0.0],
             "machine": f"{os.cpu_count()} cores, {mem_total / GiB:.1f} GiB RAM, {disk_free / 1e9:.0f} GB free disk",
             "largest": largest_trainable(agg, mem_total, disk_free)}
    base = out / f"bench_offload_{stamp}"
    base.with_suffix(".json").write_text(json.dumps(saved, indent=1))
    md = (_largest.markdown(saved) if args.largest else markdown(saved)) + f"\n({saved['minutes']:.1f} min)\n"
    base.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
