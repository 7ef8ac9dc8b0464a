"""Serving (issue 26): decode tokens/s and time to first token of `zerospeed.init_inference` against plain Hugging
Face `generate` and DeepSpeed's `init_inference`, on random-init GPT-2s, in one run.

    python bench/bench_inference.py --repeats 2                                # the full table (see bench/README.md)
    python bench/bench_inference.py --models 124m --batches 1 --new-tokens 8 --prompt 16 \
        --systems hf-fp32,zs-fp32,zs-tp2-fp32,deepspeed-fp32 --repeats 1       # a quick look (~4 min)
    python bench/bench_inference.py --report bench/results/bench_inference_<stamp>.json   # re-render a saved run

Models: `transformers.GPT2LMHeadModel` from `GPT2Config()` (124m: 12 x 768, 12 heads) and with n_embd 1024,
n_layer 24, n_head 16 (350m), vocabulary 50257, tied lm_head, built after `torch.manual_seed(0)`, `.eval()`, no
download. Systems, each (model, batch, system) its own process (`bench/_inference_worker.py`):

    hf-fp32 / hf-bf16        plain `model.generate` (bf16: `model.to(torch.bfloat16)`), HF's dynamic cache
    zs-fp32 / -bf16 / -int8  `zerospeed.init_inference(model, dtype=..., replace_with_kernel_inject=True)`
    zs-fp32-noinject         the same without kernel injection (what the injection buys)
    zs-fp32-nofreeze         injection with set_empty_params=True: the decode step compiled without freezing
    zs-fp32-compile          injection with ZEROSPEED_AOT_DECODE=0: the torch.compile decode step (zs-fp32 and
                             zs-int8 serve it as an AOTInductor package since session 36; zs-fp32-aot before)
    zs-tp2-fp32 / -bf16      world 2 (torchrun), tensor_parallel={"tp_size": 2} + injection; rank 0's times
    deepspeed-fp32           `deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=False)`

Prompt: `--prompt` random token ids (fixed seed), batch `--batches`, greedy, exactly `--new-tokens` tokens per call
(eos_token_id=None), pad_token_id 0, attention mask of ones. Per launch: one warm-up generate of the measured
shapes (compiles the injected decode step), the prefill (TTFT) as the median of 5 `generate(max_new_tokens=1)` calls,
then `--inner` timed generates, each between two read probes (rank 0). World 1: 2 threads; world 2: 1 thread per
rank. The machine's read bandwidth and eager GEMV rate are measured before and after the systems, each in a
process of its own. Repeats are interleaved (the system order rotates by one per repeat); the table shows medians.
Writes bench/results/bench_inference_<stamp>.{md,json} and the launch logs under
bench/results/logs_inference_<stamp>/.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import raise_interrupt, write_results  # noqa: E402
from bench_zero import launch  # noqa: E402

MB = 1e6
MODEL_NAMES = ("124m", "350m")
# table order; the worker holds what each one is (_inference_worker.SYSTEMS)
SYSTEM_NAMES = ("hf-fp32", "hf-bf16", "zs-fp32", "zs-bf16", "zs-int8", "zs-fp32-noinject", "zs-fp32-nofreeze",
                "zs-fp32-compile", "zs-tp2-fp32", "zs-tp2-bf16", "deepspeed-fp32")
WORLD = {"zs-tp2-fp32": 2, "zs-tp2-bf16": 2}
DTYPE = {s: s.split("-")[2] if s.startswith("zs-tp2") else s.split("-")[1] for s in SYSTEM_NAMES}
SLOW = ("hf-bf16",)  # the systems --slow-new-tokens applies to


def _strs(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return items
    return parse


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=_strs(MODEL_NAMES), default=list(MODEL_NAMES), help="comma list (default 124m,350m)")
    p.add_argument("--batches", type=_ints, default=[1, 8], help="comma list of batch sizes (default 1,8)")
    p.add_argument("--systems", type=_strs(SYSTEM_NAMES), default=list(SYSTEM_NAMES),
                   help=f"comma list (default all: {','.join(SYSTEM_NAMES)})")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per call (default 256)")
    p.add_argument("--slow-new-tokens", type=int, default=0,
                   help="hf-bf16 only: generate this many tokens per call instead (its decode rate over N-1 tokens; "
                        "0: --new-tokens, the default)")
    p.add_argument("--inner", type=int, default=2, help="timed generate calls per launch (default 2; median)")
    p.add_argument("--repeats", type=int, default=2, help="launches per configuration, interleaved (default 2)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building the model")
    p.add_argument("--prompt-seed", type=int, default=1234)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=2400.0, help="seconds per launch before it is killed")
    p.add_argument("--report", metavar="JSON", default=None, help="re-render a saved bench_inference_<stamp>.json")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.inner < 1 or args.new_tokens < 2 or args.prompt < 1 or min(args.batches) < 1:
        p.error("--repeats, --inner, --prompt and the batches must be >= 1, --new-tokens >= 2")
    if args.slow_new_tokens == 1 or args.slow_new_tokens < 0:
        p.error("--slow-new-tokens must be 0 (off) or >= 2")
    return args


def new_tokens_of(args, system: str) -> int:
    return args.slow_new_tokens if system in SLOW and args.slow_new_tokens else args.new_tokens


def worker_env(threads: int, inductor_cache: Path) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
                HF_HUB_OFFLINE="1", TORCHINDUCTOR_CACHE_DIR=str(inductor_cache))


def measure_bandwidth(models: list[str], log: Path, inductor_cache: Path) -> dict:
    """The worker's `measure_bandwidth` in a `python -c` process of its own, 2 threads."""
    code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import _inference_worker as w; "
            f"print(json.dumps(w.measure_bandwidth({models!r}, threads=2)))")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env=worker_env(2, inductor_cache))
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"status": "error", "message": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(status="ok", at=time.strftime("%H:%M:%S"), seconds=time.time() - t0, load_avg_1min=os.getloadavg()[0])
    return out


def configurations(args) -> list[tuple[str, int]]:
    return [(m, b) for m in args.models for b in args.batches]


def run_all(args, logs: Path, tmp: Path, inductor_cache: Path) -> tuple[list[dict], bool]:
    from bench_zero import _log_tail

    configs = configurations(args)
    systems = list(args.systems)
    runs, failed, k = [], {}, 0
    n = len(configs) * len(systems) * args.repeats
    try:
        for rep in range(args.repeats):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for model, batch in configs:
                for system in order:
                    k += 1
                    name = f"{model}_b{batch}_{system}_r{rep}"
                    key = (model, batch, system)
                    if system.startswith("deepspeed") and key in failed:  # DeepSpeed's refusal does not change
                        print(f"[{k}/{n}] {name}: failed in an earlier repeat, not relaunched", file=sys.stderr,
                              flush=True)
                        continue
                    world = WORLD.get(system, 1)
                    result = tmp / f"{name}.json"
                    worker = [str(HERE / "_inference_worker.py"), "--system", system, "--model", model,
                              "--batch", str(batch), "--prompt", str(args.prompt),
                              "--new-tokens", str(new_tokens_of(args, system)), "--inner", str(args.inner),
                              "--seed", str(args.seed), "--prompt-seed", str(args.prompt_seed),
                              "--result", str(result), "--launch-time", str(time.time())]
                    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            str(world), *worker] if world > 1 else [sys.executable, *worker])
                    load = os.getloadavg()[0]
                    env = worker_env(2 if world == 1 else 1, inductor_cache)
                    code, wall = launch(cmd, logs / f"{name}.log", args.timeout, env=env)
                    if result.exists():
                        run = json.loads(result.read_text())
                        run.pop("traceback", None)
                    else:
                        why = "timed out" if code is None else f"exit code {code}"
                        run = {"status": "error", "message": f"{why}: {_log_tail(logs / f'{name}.log')}"}
                    run.update(system=system, model=model, batch=batch, repeat=rep, world_size=world,
                               new_tokens=new_tokens_of(args, system), load_avg_1min=load, wall_s=wall)
                    if run["status"] != "ok":
                        failed[key] = run.get("message", "")
                    runs.append(run)
                    what = (f"{_f(decode_tps(run), ',.1f')} tok/s decode, prefill {statistics.median(run['prefill_s']):.3f} s, "
                            f"warm-up {run['warmup_s']:.1f} s" if run["status"] == "ok"
                            else f"{run['status']}: {run.get('message', '')[:150]}")
                    print(f"[{k}/{n}] {name}: {what} ({wall:.0f} s, load {load:.1f})", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("bench_inference: interrupted; reporting the runs finished so far", file=sys.stderr)
        return runs, True
    return runs, False


# -- aggregation -------------------------------------------------------------------------------------------------
def decode_tps(run: dict) -> float | None:
    """B x (N - 1) / (median generate(N) - median prefill): the tokens after the first over the time after it.
    None when the prefill took as long as the whole generate (noise: another job stole the cores)."""
    gen, pre = statistics.median(run["gen_s"]), statistics.median(run["prefill_s"])
    return run["batch"] * (run["new_tokens"] - 1) / (gen - pre) if gen > pre else None


def step_bytes(run: dict) -> float:
    """Weight bytes read per decode step, summed over the ranks: every parameter and buffer once (the tied
    wte once, as the lm_head's matrix), less the position table (a lookup of one row)."""
    return float(sum(w - p for w, p in zip(run["weight_bytes"], run["wpe_bytes"])))


def of_own_bound(run: dict) -> float | None:
    """Decode tok/s of one launch over its own bound, B x read bandwidth / bytes per decode step. Since session 24
    each timed generate against the mean of the read probes just before and just after it (`gen_read_gbs`), the
    median over the generates; runs of sessions 22-23: the launch's rate against a probe at its end
    (`launch_read_gbs`). None without either or without a decode rate."""
    reads, pre = run.get("gen_read_gbs"), statistics.median(run["prefill_s"])
    if reads and all(reads):
        # (B (N - 1) / (g - pre)) tok/s against B x bandwidth / bytes: B cancels
        per_gen = [(run["new_tokens"] - 1) / (g - pre) * step_bytes(run) / ((a + b) / 2 * 1e9)
                   for g, a, b in zip(run["gen_s"], reads, reads[1:]) if g > pre]
        return statistics.median(per_gen) if per_gen else None
    rate, gbs = decode_tps(run), run.get("launch_read_gbs")
    return rate * step_bytes(run) / (run["batch"] * gbs * 1e9) if rate and gbs else None


def launch_read(run: dict) -> float | None:
    """The launch's own read bandwidth, GB/s: the median of its probes around the timed generates (or the one at
    its end, sessions 22-23)."""
    reads = [x for x in run.get("gen_read_gbs") or [] if x]
    return statistics.median(reads) if reads else run.get("launch_read_gbs")


def read_bw(saved: dict) -> float | None:
    """The bound's bandwidth: the higher of the before / after measurements (GB/s)."""
    bws = [b["read_gbs"] for b in (saved.get("bw_before"), saved.get("bw_after")) if b and b.get("status") == "ok"]
    return max(bws) if bws else None


def short(message: str, n: int = 90) -> str:
    return ((message or "failed").strip().splitlines() or ["failed"])[0][:n].replace("|", "/")


def aggregate(runs: list[dict], bw: float | None) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["model"], r["batch"], r["system"]), []).append(r)
    rows = []
    for (model, batch, system), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        row = {"model": model, "batch": batch, "system": system, "dtype": DTYPE[system], "repeats": len(ok),
               "status": "ok" if ok else rs[0]["status"], "message": rs[0].get("message", "")}
        if ok:
            first = min(ok, key=lambda r: r["repeat"])
            rates = [decode_tps(r) for r in ok]
            valid = [x for x in rates if x is not None]
            row.update(
                decode_tps=statistics.median(valid) if valid else None,
                decode_tps_all=rates,
                prefill_s=statistics.median(statistics.median(r["prefill_s"]) for r in ok),
                gen_s=statistics.median(statistics.median(r["gen_s"]) for r in ok),
                weight_bytes=max(max(r["weight_bytes"]) for r in ok),
                step_bytes=max(step_bytes(r) for r in ok),
                peak_rss_bytes=statistics.median(max(r["peak_rss_bytes"]) for r in ok),
                rss_growth_bytes=statistics.median(max(p - s for p, s in zip(r["peak_rss_bytes"], r["start_rss_bytes"]))
                                                   for r in ok),
                warmup_s=first["warmup_s"], warmup_s_all=[r["warmup_s"] for r in ok],
                setup_s=statistics.median(r["setup_s"] for r in ok), new_tokens=first["new_tokens"],
                world_size=first["world_size"], n_params=first["n_params"], tokens=first["tokens"])
            if bw:
                row["bound_tps"] = batch * bw * 1e9 / row["step_bytes"]
                row["of_bound_run"] = row["of_bound"] = row["decode_tps"] / row["bound_tps"] if valid else None
            own = [x for x in map(of_own_bound, ok) if x is not None]
            if own:  # each generate against the bandwidth measured around it: the same neighbours, the same minute
                row["of_bound"] = statistics.median(own)
                row["launch_read_gbs"] = statistics.median(x for x in map(launch_read, ok) if x)
            comm = [r for r in ok if r.get("collective_s")]
            if comm:  # tp: the step's collectives, counted and timed per launch
                row["collectives_per_token"] = comm[0]["collectives_per_token"]
                row["collective_s"] = {op: statistics.median(r["collective_s"][op] for r in comm)
                                       for op in comm[0]["collective_s"]}
                inside = [in_step_seconds_per_step(r) for r in comm]
                inside = [x for x in inside if x is not None]
                if inside:  # the same collectives timed inside the timed generates' steps (since session 35)
                    row["in_step_collective_s_per_step"] = statistics.median(inside)
            if len(valid) < len(rates):
                row["note"] = (f"{len(rates) - len(valid)} of {len(rates)} launches: prefill >= generate (no decode "
                               "rate: the machine was busy)")
            if len(ok) < len(rs):
                row["note"] = f"{len(rs) - len(ok)} of {len(rs)} repeats failed: {short(next(r for r in rs if r not in ok).get('message', ''))}"
        rows.append(row)
    by = {(r["model"], r["batch"], r["system"]): r for r in rows if r["status"] == "ok"}
    for row in rows:
        if row["status"] != "ok":
            continue
        hf32, hf16 = by.get((row["model"], row["batch"], "hf-fp32")), by.get((row["model"], row["batch"], "hf-bf16"))
        row["x_hf_fp32"] = _div(row["decode_tps"], hf32 and hf32["decode_tps"])
        row["x_hf_bf16"] = _div(row["decode_tps"], hf16 and hf16["decode_tps"]) if row["dtype"] == "bf16" else None
        row["tokens_vs_hf_fp32"] = _agreement(row["tokens"], hf32["tokens"]) if hf32 and hf32 is not row else None
    rows.sort(key=lambda r: (MODEL_NAMES.index(r["model"]), r["batch"], SYSTEM_NAMES.index(r["system"])))
    return rows


def _div(a, b):
    return a / b if a is not None and b else None


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy tokens against hf-fp32's: sequences identical, and the first differing position of the others."""
    n = min(len(a[0]), len(b[0]))
    firsts = [next((i for i in range(n) if x[i] != y[i]), None) for x, y in zip(a, b)]
    diverged = [f for f in firsts if f is not None]
    return {"compared": n, "identical": len(firsts) - len(diverged), "sequences": len(firsts),
            "first_diff": min(diverged) if diverged else None}


# -- the report --------------------------------------------------------------------------------------------------
def _f(x, spec: str, none: str = "—") -> str:
    return none if x is None else format(x, spec)


HEADER = ("| model | batch | system | decode tok/s | x HF fp32 | x HF bf16 | fraction of bound | prefill s (TTFT) "
          "| weight MB/rank | peak RSS MB/rank | compile/warm-up s |")


def markdown_table(rows: list[dict], new_tokens: int) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count(" | ") + 1)]
    for r in rows:
        head = f"| {r['model']} | {r['batch']} | {r['system']} |"
        if r["status"] != "ok":
            word = "fails" if r["system"].startswith("deepspeed") else r["status"]
            lines.append(f"{head} {word}: {short(r.get('message', ''))} |" + " — |" * 7)
            continue
        slow = "†" if r["new_tokens"] != new_tokens else ""
        lines.append(
            f"{head} {_f(r['decode_tps'], ',.1f')}{slow} | {_f(r['x_hf_fp32'], '.2f')} | {_f(r['x_hf_bf16'], '.2f')} | "
            f"{_f(r.get('of_bound'), '.2f')} | {r['prefill_s']:.3f} | {r['weight_bytes'] / MB:,.0f} | "
            f"{r['peak_rss_bytes'] / MB:,.0f} | {r['warmup_s']:.1f} |")
    return "\n".join(lines)


def comm_seconds_per_token(row: dict) -> float | None:
    """Seconds of collectives per decode step of a tp row: each op counted in the step times its measured
    seconds per call (all-gathers at the logits' all-gather time, the rest at the hidden-state all-reduce's)."""
    calls, secs = row.get("collectives_per_token"), row.get("collective_s")
    if not calls or not secs:
        return None
    return sum(n * secs["all_gather" if "gather" in op else "all_reduce"] for op, n in calls.items())


def in_step_seconds_per_step(launch: dict) -> float | None:
    """Seconds one rank spends inside a step's collectives, from a tp launch's timed generates (the worker's
    `InStepCollectives`: seconds and calls per generate): the median over its generates of seconds per call,
    times the collectives one step issues (`collectives_per_token`). The prefill's few larger messages are
    among the calls (1 forward in N)."""
    secs, calls = launch.get("in_step_collective_s"), launch.get("in_step_collective_calls")
    per_step = sum((launch.get("collectives_per_token") or {}).values())
    if not secs or not calls or not per_step:
        return None
    return statistics.median(s / n for s, n in zip(secs, calls) if n) * per_step


def tp_limits(tp: dict, tp1: dict, c: float | None = None) -> tuple[float, float] | None:
    """(tp 2 ÷ tp 1 this machine allows, what a node of 2 devices with their own memory would reach) from
    tp 1's time per decode step t1 and the tp row's collective seconds per step c (default: each collective
    timed alone, `comm_seconds_per_token`; the row's `in_step_collective_s_per_step`: as they run in the step):
    here the two ranks share one memory bus, so reading half the weights each takes t1 still: t1 / (t1 + c);
    with a memory per device each reads its half in t1 / 2: t1 / (t1 / 2 + c), with this machine's collective
    time."""
    c = comm_seconds_per_token(tp) if c is None else c
    if c is None or not tp1.get("decode_tps"):
        return None
    t1 = tp1["batch"] / tp1["decode_tps"]
    return t1 / (t1 + c), t1 / (t1 / 2 + c)


def bf16_limit(zs16: dict, hf16: dict) -> float | None:
    """The largest zs-bf16 ÷ hf-bf16 the bandwidth allows: zs-bf16's bound (B x read bandwidth / its bytes per
    step; the launches' own probes, or the run's) over hf-bf16's decode rate."""
    gbs = zs16.get("launch_read_gbs")
    bound = zs16["batch"] * gbs * 1e9 / zs16["step_bytes"] if gbs else zs16.get("bound_tps")
    return _div(bound, hf16.get("decode_tps"))


def targets_table(rows: list[dict], batches: list[int], kernel_of_probe: dict | None = None) -> str:
    """Issue 26's targets, per model, from the table's rows: measured value, met / missed, and for the targets
    the machine caps the limit it allows (`tp_limits`, `bf16_limit`; the fraction of the bound: the decode
    step's GEMV kernel's read rate over the probe's, `kernel_of_probe` per model, when measured)."""
    by = {(r["model"], r["batch"], r["system"]): r for r in rows if r["status"] == "ok"}
    lines = ["| model | target | measured | | limit on this machine |", "|---|---|---|---|---|"]

    def add(model, what, value, ok, why="", limit=""):
        if value is None:
            lines.append(f"| {model} | {what} | — | not measured{why} | {limit} |")
        else:
            lines.append(f"| {model} | {what} | {value:.2f} | {'met' if ok(value) else 'missed'} | {limit} |")

    def ratio(model, b, sys_a, sys_b, key="decode_tps"):
        a, c = by.get((model, b, sys_a)), by.get((model, b, sys_b))
        return _div(a[key], c[key]) if a and c else None

    for model in dict.fromkeys(r["model"] for r in rows):
        zs1 = by.get((model, 1, "zs-fp32"))
        cap = (kernel_of_probe or {}).get(model)
        add(model, "zs-fp32 B=1 decode, fraction of bound >= 0.85", zs1.get("of_bound") if zs1 else None,
            lambda x: x >= 0.85, limit=f"{cap:.2f} (the GEMV kernel's read rate ÷ the probe's, before attention and "
                                       "the Python around the step)" if cap else "")
        add(model, "zs-fp32 B=1 decode ÷ hf-fp32 >= 1.2", ratio(model, 1, "zs-fp32", "hf-fp32"), lambda x: x >= 1.2)
        add(model, "zs-fp32 B=8 decode ÷ hf-fp32 >= 2", ratio(model, 8, "zs-fp32", "hf-fp32"), lambda x: x >= 2)
        for b in batches:
            zs16, hf16 = by.get((model, b, "zs-bf16")), by.get((model, b, "hf-bf16"))
            cap = bf16_limit(zs16, hf16) if zs16 and hf16 else None
            add(model, f"zs-bf16 B={b} decode ÷ hf-bf16 >= 10", ratio(model, b, "zs-bf16", "hf-bf16"), lambda x: x >= 10,
                limit=f"{cap:.2f} (zs-bf16's bandwidth bound ÷ hf-bf16)" if cap else "")
            add(model, f"zs-bf16 B={b} decode ÷ zs-fp32 >= 0.7", ratio(model, b, "zs-bf16", "zs-fp32"), lambda x: x >= 0.7)
        wb = next((ratio(model, b, "zs-int8", "zs-fp32", "weight_bytes") for b in batches
                   if ratio(model, b, "zs-int8", "zs-fp32", "weight_bytes") is not None), None)
        add(model, "zs-int8 weight bytes ÷ zs-fp32's <= 0.3", wb, lambda x: x <= 0.3)
        wt = next((ratio(model, b, "zs-tp2-fp32", "zs-fp32", "weight_bytes") for b in batches
                   if ratio(model, b, "zs-tp2-fp32", "zs-fp32", "weight_bytes") is not None), None)
        add(model, "zs-tp2-fp32 weight bytes/rank ÷ zs-fp32's <= 0.55", wt, lambda x: x <= 0.55)
        for b in batches:
            tp, tp1 = by.get((model, b, "zs-tp2-fp32")), by.get((model, b, "zs-fp32"))
            lim = tp_limits(tp, tp1) if tp and tp1 else None
            inside = tp.get("in_step_collective_s_per_step") if tp else None
            lin = tp_limits(tp, tp1, inside) if tp and tp1 and inside else None
            text = (f"{lim[0]:.2f} (one memory bus; {comm_seconds_per_token(tp) * 1e3:.1f} ms of collectives per step "
                    f"timed alone); {lim[1]:.2f} with a memory per device" if lim else "")
            if lin:
                text += (f"; with the {inside * 1e3:.1f} ms they take inside the step: {lin[0]:.2f} "
                         f"(one bus), {lin[1]:.2f} (a memory per device)")
            add(model, f"zs-tp2-fp32 B={b} decode ÷ zs-fp32 >= 0.8", ratio(model, b, "zs-tp2-fp32", "zs-fp32"),
                lambda x: x >= 0.8, limit=text)
        for b in batches:
            add(model, f"zs-fp32 B={b} prefill (TTFT) ÷ hf-fp32's <= 1.10",
                ratio(model, b, "zs-fp32", "hf-fp32", "prefill_s"), lambda x: x <= 1.10)
    return "\n".join(lines)


def agreement_lines(rows: list[dict]) -> str:
    out = []
    for r in rows:
        a = r.get("tokens_vs_hf_fp32") if r["status"] == "ok" else None
        if a is None:
            continue
        what = ("identical" if a["identical"] == a["sequences"]
                else f"{a['identical']}/{a['sequences']} sequences identical, first difference at token {a['first_diff']}")
        out.append(f"{r['model']} B={r['batch']} {r['system']}: {what} (first {a['compared']} tokens)")
    return "; ".join(out)


def _launch_bw(rows: list[dict]) -> str:
    """The spread of the launches' own bandwidth probes, when the run has them."""
    gbs = [r["launch_read_gbs"] for r in rows if r.get("launch_read_gbs")]
    if not gbs:
        return ""
    return (f", or each launch's own, measured around its timed generates ({min(gbs):.1f}-{max(gbs):.1f} GB/s over "
            "the rows), for the fraction of bound")


def _kernel_of_probe(saved: dict) -> dict:
    """model -> the GEMV kernel's read rate over the probe's, the mean of the run's two bandwidth measurements."""
    got = [b["kernel_of_probe"] for b in (saved.get("bw_before"), saved.get("bw_after"))
           if b and b.get("status") == "ok" and b.get("kernel_of_probe")]
    return {m: statistics.mean(g[m] for g in got if m in g) for m in {m for g in got for m in g}}


def _bw_line(label: str, b: dict | None) -> str:
    if not b:
        return f"{label}: not measured"
    if b.get("status") != "ok":
        return f"{label}: failed ({b.get('message', '')})"
    gemv = ", ".join(f"{m} {v:.1f}" for m, v in b["gemv_gbs"].items())
    pages = {True: "on huge pages", False: "on 4 KiB pages (the OS refused huge ones)"}.get(b.get("probe_huge_pages"),
                                                                                         "4 KiB pages")
    four_k = f", {b['read_gbs_4k']:.1f} on 4 KiB pages" if b.get("read_gbs_4k") else ""
    kernel = ", ".join(f"{m} {v:.2f}" for m, v in (b.get("kernel_of_probe") or {}).items())
    kernel = f"; the decode step's frozen GEMV template over the lm_head, huge pages, ÷ the probe: {kernel}" if kernel else ""
    return (f"{label} ({b['at']}, load {b['load_avg_1min']:.1f}): read {b['read_gbs']:.1f} GB/s "
            f"(x.sum() over 512 MiB fp32 {pages}, 2 threads, median of {b['trials']}{four_k}); eager fp32 GEMV over "
            f"the model's matrices: {gemv} GB/s{kernel}")


NOTES = (
    "decode tok/s = B x (N - 1) / (generate(N) - prefill), medians over the `inner` timed generate calls of a launch "
    "and the prefill's 5 calls, then the median over repeats (N = new tokens; the first token comes from the "
    "prefill). x HF fp32 / x HF bf16: decode tok/s over hf-fp32's / hf-bf16's of the same model and batch (the latter "
    "for bf16 rows only). fraction of bound: decode tok/s over B x read bandwidth / bytes per decode step, per "
    "timed generate with the bandwidth measured just before and just after it (mean of the two; x.sum() over 512 MiB, "
    "on 2 MiB huge pages since session 26 - as kernel injection's weights - and 4 KiB pages before, "
    "median of 3, 2 threads, rank 0; since session 24, the end of the launch in sessions 22-23: the machine's probe "
    "moves 26-55 GB/s within an hour), median over generates and repeats (runs without it: the "
    "higher of the run's two probes); the bytes "
    "being every parameter and buffer of the served module once (`weight_bytes`, the tied wte once, as the lm_head's "
    "matrix) less the position table, summed over the ranks for tp 2 (both ranks read at once from the one memory); "
    "KV-cache and activation traffic are not counted, and inductor's frozen, prepacked copy of the weights (read "
    "instead of the originals) has their size. prefill s (TTFT): median of 5 `generate(max_new_tokens=1)` calls of "
    "a launch (since session 22; a forward `module(input_ids, attention_mask, use_cache=True, logits_to_keep=1)` "
    "before), each system through its own path (injection: its static cache from the warm-up, no recompile: the "
    "one-token generate never runs the compiled decode step), then the median over repeats. weight MB/rank: "
    "`zerospeed.inference.quant.weight_bytes(engine.module)` (params + buffers, shared "
    "storages once; 1 MB = 1e6 B), the larger rank; it does not see inductor's frozen copy of the weights, which the "
    "peak RSS does. peak RSS MB/rank: VmHWM of the larger rank (python, torch, transformers and, for DeepSpeed, its "
    "import included), median over repeats. compile/warm-up s: the first, untimed generate of the first repeat "
    "(kernel injection compiles its decode step there; inductor's cache is a fresh directory per invocation, so "
    "later repeats may reuse its compiled code: the JSON has every repeat's).")


def report(saved: dict, base: Path) -> str:
    a, runs = saved["args"], saved["runs"]
    bw = read_bw(saved)
    rows = aggregate(runs, bw)
    loads = [r["load_avg_1min"] for r in runs]
    params = {r["model"]: r["n_params"] for r in rows if r.get("n_params")}
    header = (f"bench_inference {saved['stamp']}: random-init GPT-2 ({', '.join(f'{m} {p / 1e6:.1f}M' for m, p in params.items())} "
              f"parameters), prompt {a['prompt']} tokens, {a['new_tokens']} new tokens per generate (greedy, exactly N), "
              f"batches {', '.join(map(str, a['batches']))}, 1 warm-up + {a['inner']} timed generates per launch, "
              f"{a['repeats']} interleaved repeat(s) (medians); world 1 with 2 threads, tp 2 with 1 thread per rank; "
              f"torch {saved['torch']}, transformers {saved['transformers']}, deepspeed {saved.get('deepspeed') or 'n/a'}, "
              f"{saved['cpu']}; 1-min load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f}; "
              f"{saved['elapsed_s'] / 60:.1f} min in all. zerospeed: {saved['zerospeed_source']}.")
    bw_text = (f"{_bw_line('Bandwidth before', saved.get('bw_before'))}.  \n{_bw_line('after', saved.get('bw_after'))}.  \n"
               f"The bound uses the higher read bandwidth: {_f(bw, '.1f')} GB/s" + _launch_bw(rows) + ".")
    slow = ""
    if a.get("slow_new_tokens"):
        slow = (f"\n† hf-bf16 generates {a['slow_new_tokens']} tokens per call instead of {a['new_tokens']} "
                f"(`--slow-new-tokens`): its decode rate over {a['slow_new_tokens'] - 1} tokens, its KV cache shorter.\n")
    agree = agreement_lines(rows)
    md = (f"{header}\n\n{bw_text}\n\n{markdown_table(rows, a['new_tokens'])}\n{slow}\n{NOTES}\n\n"
          + (f"Greedy tokens against hf-fp32's (same model, batch; random init: near-flat logits, so rounding can "
             f"flip an argmax): {agree}.\n\n" if agree else "")
          + f"Targets (issue 26):\n\n{targets_table(rows, a['batches'], _kernel_of_probe(saved))}\n")
    notes = [f"{r['model']} B={r['batch']} {r['system']}: {r['note']}" for r in rows if r.get("note")]
    if notes:
        md += "\n" + "\n".join(notes) + "\n"
    if saved.get("interrupted"):
        md += "\nInterrupted: incomplete.\n"
    return write_results(base, md, saved, [{k: v for k, v in r.items() if k != "tokens"} for r in rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print(report(saved, Path(args.report).with_suffix("")))
        return 0
    signal.signal(signal.SIGTERM, raise_interrupt)  # like Ctrl-C: stop the launch, report what finished
    from importlib.metadata import version

    from bench_zero import _cpu_name, zerospeed_source

    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = Path(args.out)
    logs = out / f"logs_inference_{stamp}"
    logs.mkdir(parents=True)
    ds_version = None
    if any(s.startswith("deepspeed") for s in args.systems):
        if importlib.util.find_spec("deepspeed") is None:
            print("bench_inference: deepspeed is not importable: its rows are left out", file=sys.stderr)
            args.systems = [s for s in args.systems if not s.startswith("deepspeed")]
        else:
            ds_version = version("deepspeed")
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="bench_inference_"))
    inductor_cache = tmp / "inductor"
    runs, interrupted, bw_before, bw_after, source = [], False, None, None, "?"
    try:
        _, source = zerospeed_source(None, tmp / "unused")
        n = len(configurations(args)) * len(args.systems) * args.repeats
        print(f"bench_inference: {n} launches; zerospeed from {source}; logs in {logs}", file=sys.stderr, flush=True)
        print("bench_inference: measuring the bandwidth ...", file=sys.stderr, flush=True)
        bw_before = measure_bandwidth(args.models, logs / "bandwidth_before.log", inductor_cache)
        print(f"bench_inference: {_bw_line('bandwidth before', bw_before)}", file=sys.stderr, flush=True)
        runs, interrupted = run_all(args, logs, tmp, inductor_cache)
        if not interrupted:
            bw_after = measure_bandwidth(args.models, logs / "bandwidth_after.log", inductor_cache)
            print(f"bench_inference: {_bw_line('bandwidth after', bw_after)}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    saved = {"stamp": stamp, "args": vars(args), "elapsed_s": time.time() - t0, "torch": version("torch"),
             "transformers": version("transformers"), "deepspeed": ds_version, "cpu": _cpu_name(),
             "zerospeed_source": source, "interrupted": interrupted,
             "bw_before": bw_before, "bw_after": bw_after, "runs": runs}
    print(report(saved, out / f"bench_inference_{stamp}"))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
