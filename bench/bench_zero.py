"""zerospeed against DDP, FSDP2 and DeepSpeed, in one run, on the same model, data, seed and machine.

    python bench/bench_zero.py                                   # everything (see bench/README.md)
    python bench/bench_zero.py --models small --steps 6 --warmup 2
    python bench/bench_zero.py --systems ddp,zerospeed --stages 0,1 --precisions fp32 --repeats 3
    python bench/bench_zero.py --models small --precisions fp32 --param-groups 2,1 --repeats 2   # A/B

Every system's AdamW runs over the same parameter groups: by default (`--param-groups 2`) weight decay
0.1 on parameters with ndim >= 2, 0.0 on the rest (HF Trainer's decay/no-decay split, what users run);
`--param-groups 1`: one group, weight decay 0.0 (the table before issue 17); `2,1`: both, interleaved.

Each (system, stage, precision, model, param groups, repeat) is its own torchrun launch
(`python -m torch.distributed.run --standalone --nproc-per-node N bench/_worker.py ...`,
OMP_NUM_THREADS=1), run one after another. Repeats are interleaved: every system runs once before
any runs again, and each repeat starts one system later, so slow phases of a shared machine spread
over all systems; the table reports medians over repeats. The matmul peak for MFU is measured once,
at the start, in this process with one thread. Writes <out>/bench_zero_<timestamp>.{md,json,png}
and the launch logs under <out>/logs_<timestamp>/.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import (EQUIVALENT_STAGE, ORDER, aggregate, chart, groups_ab_table, markdown_table,  # noqa: E402
                     run_tokens_per_s, system_label)
from _systems import PARAM_GROUPS, WEIGHT_DECAY  # noqa: E402

from zerospeed.demo.data import load_corpus, sample_batch, split_corpus  # noqa: E402
from zerospeed.profiling.peak import measure_matmul_peak_flops  # noqa: E402
from zerospeed.testing.models import GPT_SIZES  # noqa: E402

SYSTEMS = ("ddp", "fsdp2", "deepspeed", "zerospeed")
# Run only when named: DDP without its all-reduce, the compute floor (see _systems.DDPNoCommRunner).
EXTRA_SYSTEMS = ("ddp_nocomm",)


def _csv(choices):
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if str(t) not in [str(c) for c in choices]]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(map(str, choices))}")
        return [type(choices[0])(t) for t in items]
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", type=_csv(SYSTEMS + EXTRA_SYSTEMS), default=list(SYSTEMS),
                   help="comma list (default: all but ddp_nocomm: DDP with its all-reduce skipped, the compute "
                        "floor, not a valid training run)")
    p.add_argument("--stages", type=_csv((0, 1, 2, 3)), default=[0, 1, 2, 3],
                   help="ZeRO stages for deepspeed and zerospeed (default: 0,1,2,3)")
    p.add_argument("--precisions", type=_csv(("fp32", "bf16")), default=None,
                   help="comma list (default: fp32,bf16, but only fp32 where bf16 matmuls are emulated (the bf16 "
                        "matmul peak is under a quarter of fp32's): there every bf16 run is 10-20x slower; "
                        "name bf16 explicitly to run it anyway)")
    p.add_argument("--models", type=_csv(("demo", "small", "base")), default=["small", "base"],
                   help="comma list of testing.models.GPT_SIZES: demo (1.85M, the demo job's; issue 3), small (10.8M), base (85M)")
    p.add_argument("--param-groups", type=_csv(PARAM_GROUPS), default=[2],
                   help="the optimizer's parameter groups, in every system: 2 = weight decay 0.1 on ndim >= 2 and "
                        "0.0 on biases/LayerNorm (default, HF Trainer's split), 1 = one group with weight decay 0.0 "
                        "(the single-group table); '2,1' runs both for every configuration, back to back "
                        "(alternating which goes first), for an A/B table")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run (at least 1)")
    p.add_argument("--repeats", type=int, default=1, help="launches per configuration, interleaved")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per launch before it is killed (default: 300 + 60 s per step small, 500 s base)")
    p.add_argument("--zerospeed-ref", metavar="GIT_REF", default=None,
                   help="benchmark zerospeed as committed at GIT_REF (its src/ extracted with `git archive` into a "
                        "temp dir and put first on the workers' PYTHONPATH) instead of the working tree: "
                        "for before/after comparisons, or a stable snapshot while others edit src/")
    p.add_argument("--baseline-ref", metavar="GIT_REF", default=None,
                   help="also benchmark zerospeed as committed at GIT_REF (rows 'zerospeed before'), interleaved "
                        "with every other launch: a before/after comparison within one run")
    p.add_argument("--report", metavar="JSON", default=None,
                   help="only re-render the table and chart of a saved bench_zero_<timestamp>.json")
    p.add_argument("--profile", action="store_true",
                   help="also write a torch.profiler table of one extra step per run (under the logs directory)")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1 or args.world_size < 1:
        p.error("--warmup, --steps, --repeats and --world-size must be >= 1 (the optimizer state exists after "
                "the first step; model states are measured at the last one)")
    return args


def configurations(args) -> list[tuple[str, int]]:
    out = []
    for system in args.systems:
        if system in EQUIVALENT_STAGE:  # not a ZeRO system: one configuration
            out.append((system, EQUIVALENT_STAGE[system]))
        else:
            out.extend((system, s) for s in args.stages)
    if getattr(args, "baseline_ref", None):
        out.extend(("zerospeed_before", s) for s in args.stages)
    return out


def write_batches(path: Path, *, world: int, steps: int, micro: int, seq_len: int, seed: int) -> None:
    """The demo's text windows every run trains on: uint8 [world, steps, micro, seq + 1]; rank r draws
    from the demo's train split with generator seed*1000 + r (as the demo does)."""
    corpus = load_corpus()
    train = split_corpus(corpus, min(1 << 20, corpus.numel() // 10)).train
    out = torch.empty(world, steps, micro, seq_len + 1, dtype=torch.uint8)
    for r in range(world):
        gen = torch.Generator().manual_seed(seed * 1000 + r)
        for i in range(steps):
            x, y = sample_batch(train, micro, seq_len, gen)
            out[r, i] = torch.cat([x, y[:, -1:]], dim=1).to(torch.uint8)
    torch.save(out, path)


def measure_peak() -> dict:
    """Best single-thread matmul rate per dtype (the worker ranks run with one thread each)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"fp32": measure_matmul_peak_flops(torch.float32, 1024, "cpu", repeats=20),
                "bf16": measure_matmul_peak_flops(torch.bfloat16, 512, "cpu", repeats=3)}
    finally:
        torch.set_num_threads(threads)


def _launch_env(pythonpath: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return env


def launch(cmd: list[str], log: Path, timeout: float, pythonpath: str | None = None,
           env: dict | None = None) -> tuple[int | None, float]:
    """Run `cmd` in its own process group; kill the group after `timeout` s. Returns (exit code, seconds).
    env: the whole environment to run with (default: this one with 1 OpenMP thread and `pythonpath` first)."""
    if env is None:
        env = _launch_env(pythonpath)
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=15)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            if isinstance(e, KeyboardInterrupt):
                raise
            code = None
    return code, time.time() - t0


def _log_tail(log: Path, n: int = 3) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errs[-1] if errs else " / ".join(lines[-n:]))[:300]


def zerospeed_source(ref: str | None, dest: Path) -> tuple[str | None, str]:
    """(PYTHONPATH entry for the workers or None, a description of the zerospeed code benchmarked)."""
    repo = HERE.parent

    def git(*a) -> str:
        return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, check=True).stdout.strip()

    if ref is None:
        try:
            dirty = len(git("status", "--porcelain", "--", "src").splitlines())
            return None, f"working tree {repo / 'src'} (HEAD {git('rev-parse', '--short', 'HEAD')}" + \
                (f" + {dirty} uncommitted files under src/)" if dirty else ")")
        except (OSError, subprocess.CalledProcessError):
            return None, f"{repo / 'src'} (not a git checkout)"
    sha = git("rev-parse", "--short", ref)
    dest.mkdir()
    tar = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar.stdout, check=True)
    return str(dest / "src"), f"git {ref} = {sha} (extracted to a temp dir)"


def run_all(args, logs: Path, data: Path, configs, total_steps: int,
            pythonpath: str | None = None, before_pythonpath: str | None = None) -> tuple[list[dict], bool]:
    """Launch every configuration (interleaved repeats); returns (runs, interrupted)."""
    pgs = args.param_groups
    runs, k, n_runs = [], 0, len(args.models) * len(args.precisions) * args.repeats * len(configs) * len(pgs)
    try:
        for model in args.models:
            seq = GPT_SIZES[model].seq_len
            for precision in args.precisions:
                timeout = args.timeout or 300 + (60 if model == "small" else 500) * total_steps * \
                    (15 if precision == "bf16" else 1)
                for rep in range(args.repeats):
                    order = configs[rep % len(configs):] + configs[:rep % len(configs)]
                    # A/B: the variants of one configuration back to back, the first one alternating by repeat
                    order = [(system, stage, pg) for system, stage in order
                             for pg in (pgs if rep % 2 == 0 else pgs[::-1])]
                    for system, stage, pg in order:
                        k += 1
                        name = f"{model}_{precision}_{system}_s{stage}_g{pg}_r{rep}"
                        result = data.parent / f"{name}.json"
                        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", str(args.world_size), str(HERE / "_worker.py"),
                               "--system", "zerospeed" if system == "zerospeed_before" else system, "--stage", str(stage), "--precision", precision,
                               "--model", model, "--steps", str(args.steps), "--warmup", str(args.warmup),
                               "--micro-batch", str(args.micro_batch), "--seed", str(args.seed),
                               "--param-groups", str(pg), "--data", str(data), "--result", str(result), "--launch-time", str(time.time())]
                        if args.profile:
                            cmd += ["--profile", str(logs / f"{name}.profile.txt")]
                        load = os.getloadavg()[0]
                        code, wall = launch(cmd, logs / f"{name}.log", timeout,
                                            {"zerospeed": pythonpath, "zerospeed_before": before_pythonpath}.get(system))
                        if result.exists():
                            run = json.loads(result.read_text())
                            run["system"] = system
                        else:
                            why = "timed out" if code is None else f"exit code {code}"
                            run = {"system": system, "stage": stage, "precision": precision, "model": model,
                                   "param_groups": pg, "status": "error", "message": f"{why}: {_log_tail(logs / f'{name}.log')}"}
                        run.update(repeat=rep, load_avg_1min=load, wall_s=wall, seq_len=run.get("seq_len", seq))
                        runs.append(run)
                        tps = run_tokens_per_s(run)
                        what = f"{tps:,.0f} tokens/s" if tps else run["status"] + ": " + run.get("message", "")[:120]
                        stage_txt = "" if system in EQUIVALENT_STAGE else f" stage {stage}"
                        print(f"[{k}/{n_runs}] {system_label(system, pg, len(pgs) > 1)}{stage_txt} {precision} {model} "
                              f"repeat {rep + 1}: "
                              f"{what} ({wall:.0f} s, load {load:.1f})", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("bench_zero: interrupted; reporting the runs finished so far", file=sys.stderr)
        return runs, True
    return runs, False


PG_TEXT = {2: f"2: weight decay {WEIGHT_DECAY} on ndim >= 2, 0.0 on the rest", 1: "1: one group, weight decay 0.0"}
assert set(PG_TEXT) == set(PARAM_GROUPS)

NOTES = ("Stage '-': DDP holds what ZeRO stage 0 holds, FSDP2 what stage 3 holds; they are compared with those "
         "formulas and with DeepSpeed at those stages. tokens/s = global tokens per step / median step wall time "
         "(slowest rank); CPU = process CPU time per step (all threads), less sensitive to other jobs on the "
         "machine. Model states are measured after the last backward, before its optimizer step; '+ N buffers' = "
         "communication buckets allocated besides them (DeepSpeed's ipg buckets, allocated but mostly untouched, "
         "so not in RSS); DDP's own reducer buckets are not visible and not counted. max |Δloss|: over every "
         "step, against DDP of the same precision, param groups and repeat (DDP row: across its repeats; none for 'DDP, no "
         "all-reduce', whose ranks train apart: it is the compute floor, for the share of communication). "
         "MFU: (6Ψ + 12·L·d·T) FLOPs per token x tokens/s / (matmul peak per thread x world size).")


def report(saved: dict, base: Path) -> str:
    """Aggregate, write <base>.md/.json/.png and return the markdown."""
    args, runs, peak = saved["args"], saved["runs"], saved["peak_flops"]
    peak_flops = max(peak.values())
    shapes = {m: (c.n_layer, c.d_model, c.seq_len) for m, c in GPT_SIZES.items()}
    rows = aggregate(runs, peak_flops=peak_flops, model_shapes=shapes)
    pgs = args.get("param_groups", [1])  # runs saved before the flag: one group, weight decay 0.0
    for model in args["models"]:
        for precision in saved.get("skipped_precisions", []):  # one row for every system
            rows.append({"model": model, "precision": precision, "system": "all", "stage": -1,
                         "status": "skipped", "message": saved.get("skipped_precisions_reason")})
        for precision in args["precisions"]:
            for system, stage in saved.get("configs", []):
                if system == "deepspeed" and not saved.get("has_deepspeed"):
                    rows.extend({"model": model, "precision": precision, "system": system, "stage": stage,
                                 "param_groups": pg, "status": "skipped", "message": "deepspeed not importable"}
                                for pg in pgs)
    rows.sort(key=lambda r: (list(GPT_SIZES).index(r["model"]), ("fp32", "bf16").index(r["precision"]),
                             ORDER.index(r["system"]), r["stage"], -r.get("param_groups", 1)))
    loads = [r["load_avg_1min"] for r in runs]
    ds_version = next((r["deepspeed"] for r in runs if "deepspeed" in r), None)
    header = (f"bench_zero {saved['stamp']}: world size {args['world_size']} (gloo, 1 thread per rank), micro-batch "
              f"{args['micro_batch']} x seq {'/'.join(str(GPT_SIZES[m].seq_len) for m in args['models'])} "
              f"({'/'.join(args['models'])}) per rank, {args['warmup']} warm-up + "
              f"{args['steps']} timed steps, {args['repeats']} repeat(s) (medians), AdamW lr 3e-4, no clipping, "
              f"param groups {'/'.join(map(str, pgs))} ({' / '.join(PG_TEXT[g] for g in pgs)}); "
              f"torch {saved.get('torch')}, deepspeed {ds_version or 'n/a'}, {saved.get('cpu')}; matmul peak "
              f"{peak['fp32'] / 1e9:.1f} GFLOP/s fp32 and {peak['bf16'] / 1e9:.2f} GFLOP/s bf16 per thread (MFU "
              f"against {peak_flops / 1e9:.1f} x {args['world_size']}); 1-min load average "
              f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} during the runs; "
              f"{saved['elapsed_s'] / 60:.1f} min in all. zerospeed: {saved.get('zerospeed_source')}.")
    md = f"{header}\n\n{markdown_table(rows, by_groups=len(pgs) > 1)}\n\n{NOTES}\n"
    if len(pgs) > 1:
        md += (f"\n{groups_ab_table(rows, runs)}\n\n2 groups against 1 group, same system and stage: medians "
               "over repeats; 'per repeat' = the two launches of one repeat, run back to back; below 1 = slower with "
               "2 groups (tokens/s from wall time; CPU from process CPU time per step, less sensitive to load).\n")
    if saved.get("interrupted"):
        md += "\nInterrupted: incomplete.\n"
    png = chart(rows, base.with_suffix(".png"), f"bench_zero {saved['stamp']}, world size {args['world_size']}, "
                f"{args['repeats']} repeat(s), load {min(loads, default=0):.1f}-{max(loads, default=0):.1f}")
    base.with_suffix(".md").write_text(md)
    base.with_suffix(".json").write_text(json.dumps({**saved, "rows": rows}, indent=1, default=str))
    print(f"written: {base}.md, {base}.json" + (f", {png}" if png else " (no chart: matplotlib missing or no finished run)"),
          file=sys.stderr)
    return md


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.machine()} x {os.cpu_count()}"


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # like Ctrl-C: stop the launch, report what finished
    if args.report:  # re-render a saved run
        saved = json.loads(Path(args.report).read_text())
        print(report(saved, Path(args.report).with_suffix("")))
        return 0
    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = Path(args.out)
    logs = out / f"logs_{stamp}"
    logs.mkdir(parents=True)
    configs = configurations(args)
    all_configs = list(configs)
    has_ds = importlib.util.find_spec("deepspeed") is not None
    if not has_ds and any(s == "deepspeed" for s, _ in configs):
        print("bench_zero: skipping DeepSpeed: deepspeed is not importable "
              "(DS_BUILD_OPS=0 pip install deepspeed==0.19.8 to compare)", file=sys.stderr)
        configs = [c for c in configs if c[0] != "deepspeed"]
    t_start = time.time()
    print("bench_zero: measuring the matmul peak (1 thread) ...", file=sys.stderr, flush=True)
    peak = measure_peak()
    skipped_precisions, skip_reason = [], None
    emulated = peak["bf16"] < peak["fp32"] / 4
    if emulated:
        skip_reason = (f"bf16 matmul emulated on this CPU ({peak['bf16'] / 1e9:.1f} vs {peak['fp32'] / 1e9:.0f} GFLOP/s "
                       "fp32); --precisions fp32,bf16 runs it")
    if args.precisions is None:
        args.precisions = ["fp32"] if emulated else ["fp32", "bf16"]
        if emulated:
            skipped_precisions = ["bf16"]
            print(f"bench_zero: skipping bf16: {skip_reason}", file=sys.stderr)
    elif "bf16" in args.precisions and emulated:
        print(f"bench_zero: note: {skip_reason.split(';')[0]}: bf16 runs are 10-20x slower than fp32", file=sys.stderr)
    total_steps = args.warmup + args.steps + (1 if args.profile else 0)
    tmp = Path(tempfile.mkdtemp(prefix="bench_zero_"))
    try:
        data = tmp / "batches.pt"
        write_batches(data, world=args.world_size, steps=total_steps, micro=args.micro_batch,
                      seq_len=max(GPT_SIZES[m].seq_len for m in args.models), seed=args.seed)
        n_runs = len(args.models) * len(args.precisions) * args.repeats * len(configs)
        print(f"bench_zero: peak {peak['fp32'] / 1e9:.1f} GFLOP/s fp32, {peak['bf16'] / 1e9:.2f} bf16 per thread; "
              f"{n_runs} launches of {args.warmup}+{args.steps} steps, world size {args.world_size}; logs in {logs}",
              file=sys.stderr, flush=True)
        pythonpath, zs_source = zerospeed_source(args.zerospeed_ref, tmp / "zerospeed_ref")
        print(f"bench_zero: zerospeed from {zs_source}", file=sys.stderr, flush=True)
        before_pythonpath = None
        if args.baseline_ref:
            before_pythonpath, before_source = zerospeed_source(args.baseline_ref, tmp / "zerospeed_before")
            zs_source += f"; 'zerospeed before' from {before_source}"
            print(f"bench_zero: 'zerospeed before' from {before_source}", file=sys.stderr, flush=True)
        runs, interrupted = run_all(args, logs, data, configs, total_steps, pythonpath, before_pythonpath)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    saved = {"stamp": stamp, "args": vars(args), "peak_flops": peak, "elapsed_s": time.time() - t_start,
             "torch": torch.__version__, "cpu": _cpu_name(), "zerospeed_source": zs_source,
             "configs": all_configs, "has_deepspeed": has_ds, "skipped_precisions": skipped_precisions,
             "skipped_precisions_reason": skip_reason,
             "interrupted": interrupted,
             "runs": runs}
    print(report(saved, out / f"bench_zero_{stamp}"))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
