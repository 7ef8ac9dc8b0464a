"""AutoEP (issue 25): zerospeed's AutoEP against DeepSpeed 0.19.8's on an unmodified transformers Mixtral (8 experts,
top-2), expert parallelism 2 = world size 2, in one run, on the same weights, data, seed and machine.

    python bench/bench_autoep.py                                   # small preset, fp32 + bf16, stage 0, 3 repeats
    python bench/bench_autoep.py --preset tiny --repeats 1 --steps 3 --warmup 1      # a quick look
    python bench/bench_autoep.py --report bench/results/bench_autoep_<stamp>.json    # re-render a saved run

Each (system, precision, stage, repeat) is its own launch of `_autoep_worker.py` under torchrun (2 ranks, gloo,
1 thread per rank): zerospeed with this interpreter (transformers 5.24 here), DeepSpeed with `--ds-python`, a side
virtualenv with transformers 5.18 (DeepSpeed 0.19.8's AutoEP fails with transformers 5.24 before its first step:
`TypeError: _CanRecordRegistry.get() ...`); see bench/README.md for its setup. Without it the DeepSpeed rows are
"skipped". Both get the same `expert_parallel` block (`{"enabled": true, "autoep_size": 2}` plus
`--expert-parallel`), AdamW lr 1e-4, no clipping, ZeRO `--stage`. Repeats are interleaved (zerospeed, DeepSpeed,
zerospeed, DeepSpeed, ...); the table shows medians and zerospeed ÷ DeepSpeed tokens/s per (precision, stage).
A launch that fails or times out is an "error: ..." row; it never stops the benchmark.
Writes bench/results/bench_autoep_<stamp>.{md,json} and the launch logs under bench/results/logs_autoep_<stamp>/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import MiB, raise_interrupt, run_tokens_per_s, write_results  # noqa: E402

SYSTEMS = ("zerospeed", "deepspeed")
LABEL = {"zerospeed": "zerospeed", "deepspeed": "DeepSpeed"}
DEFAULT_DS_PYTHON = Path("/work/venv-ds518/bin/python")
# The side DeepSpeed's JIT-built op (deepspeed_shm_comm_op, built at its first initialize) gets its own cache: in
# torch's default one it and the main environment's DeepSpeed (other sources, so another hash) rebuild it in turn,
# a minute or more in "launch -> first step" each time.
DS_EXTENSIONS = Path.home() / ".cache" / "torch_extensions_bench_autoep"
TARGET = 1.10  # zerospeed ÷ DeepSpeed tokens/s (issue 25)


def _csv(cast, choices):
    def parse(text: str) -> list:
        items = [cast(t.strip()) for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(map(str, choices))}")
        return items
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("tiny", "small"), default="small",
                   help="model and batch shapes (_autoep_worker.PRESETS); default small")
    p.add_argument("--precision", type=_csv(str, ("fp32", "bf16")), default=["fp32", "bf16"],
                   help="comma list (default fp32,bf16)")
    p.add_argument("--stage", type=_csv(int, (0, 1, 2)), default=[0], help="comma list of ZeRO stages (default 0)")
    p.add_argument("--systems", type=_csv(str, SYSTEMS), default=list(SYSTEMS), help="comma list (default both)")
    p.add_argument("--repeats", type=int, default=3, help="launches per (system, precision, stage), interleaved")
    p.add_argument("--steps", type=int, default=10, help="timed steps per launch (after warm-up; default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per launch (at least 1)")
    p.add_argument("--ep", type=int, default=2, help="expert_parallel.autoep_size (world size is 2)")
    p.add_argument("--expert-parallel", default="{}", metavar="JSON",
                   help="extra expert_parallel keys for both systems, e.g. '{\"use_grouped_mm\": false}'")
    p.add_argument("--ds-python", default=str(DEFAULT_DS_PYTHON) if DEFAULT_DS_PYTHON.exists() else None,
                   help=f"interpreter with deepspeed 0.19.8 + transformers 5.18 (default {DEFAULT_DS_PYTHON} if it "
                        "exists; without one the DeepSpeed rows are skipped)")
    p.add_argument("--ds-extensions", default=str(DS_EXTENSIONS),
                   help=f"TORCH_EXTENSIONS_DIR of the DeepSpeed launches (default {DS_EXTENSIONS})")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per launch before its process group is killed (default 300 + 10 s (tiny) / 60 s "
                        "(small) per step)")
    p.add_argument("--zerospeed-ref", metavar="GIT_REF", default=None,
                   help="benchmark zerospeed as committed at GIT_REF (see bench_zero.py) instead of the working tree")
    p.add_argument("--report", metavar="JSON", default=None, help="re-render a saved bench_autoep_<stamp>.json")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")
    try:
        extra = json.loads(args.expert_parallel)
    except json.JSONDecodeError as e:
        p.error(f"--expert-parallel: {e}")
    if not isinstance(extra, dict):
        p.error("--expert-parallel must be a JSON object")
    return args


def probe_interpreter(python: str, *modules: str) -> tuple[dict | None, str]:
    """({module: version} of `python`, "") when it imports every module; (None, why) otherwise."""
    code = ("import json, importlib.metadata as m; import " + ", ".join(modules) +
            "; print(json.dumps({n: m.version(n) for n in " + repr(list(modules)) + "}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, DS_ACCELERATOR="cpu"))
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python}: {e}"
    if out.returncode != 0:
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        return None, f"{python}: {lines[-1] if lines else f'exit code {out.returncode}'}"
    return json.loads(out.stdout.strip().splitlines()[-1]), ""


_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b(?::|$)")


def first_error(log: Path) -> str | None:
    """The first Python exception line of a launch log (the root cause, before torchrun's own and before the
    SignalException of a launch killed at its timeout), or None."""
    for line in log.read_text(errors="replace").splitlines():
        s = line.strip()
        if _EXC_LINE.match(s) and "ChildFailedError" not in s and "SignalException" not in s:
            return s[:300]
    return None


def run_all(args, logs: Path, data: Path, pythons: dict[str, str], pythonpath: str) -> tuple[list[dict], bool]:
    from bench_zero import _log_tail, launch

    systems = [s for s in SYSTEMS if s in args.systems]
    configs = [(p, st) for p in args.precision for st in args.stage]
    total = args.warmup + args.steps
    timeout = args.timeout or 300 + (10 if args.preset == "tiny" else 60) * total
    runs, failed, i = [], set(), 0
    n = len(configs) * args.repeats * len([s for s in systems if s in pythons])
    try:
        for rep in range(args.repeats):
            for precision, stage in configs:
                for system in systems:
                    name = f"{system}_{precision}_s{stage}_r{rep}"
                    base = {"system": system, "precision": precision, "stage": stage, "repeat": rep}
                    if system not in pythons:
                        runs.append({**base, "status": "skipped", "message": args.skip_reason})
                        continue
                    i += 1
                    if (system, precision, stage) in failed:  # a refusal does not change: launched once
                        print(f"[{i}/{n}] {name}: failed in an earlier repeat, not relaunched", file=sys.stderr,
                              flush=True)
                        continue
                    result = data.parent / f"{name}.json"
                    cmd = [pythons[system]] if system == "zerospeed" else \
                        ["env", f"TORCH_EXTENSIONS_DIR={args.ds_extensions}", pythons[system]]
                    cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(HERE / "_autoep_worker.py"), "--system", system, "--preset", args.preset,
                           "--ep", str(args.ep), "--expert-parallel", args.expert_parallel, "--stage", str(stage),
                           "--precision", precision, "--steps", str(args.steps), "--warmup", str(args.warmup),
                           "--seed", str(args.seed), "--data", str(data), "--result", str(result),
                           "--launch-time", str(time.time()), "--timeout", str(timeout)]
                    load = os.getloadavg()[0]
                    log = logs / f"{name}.log"
                    code, wall = launch(cmd, log, timeout, pythonpath)
                    if result.exists():
                        run = json.loads(result.read_text())
                    else:
                        err = first_error(log)
                        if code is None:
                            msg = f"timed out after {timeout:.0f} s" + (f" ({err})" if err else "")
                        else:
                            msg = f"{err or _log_tail(log)} (exit code {code})"
                        run = {"status": "error", "message": msg}
                    run.update(base, load_avg_1min=load, wall_s=wall)
                    if run["status"] != "ok":
                        failed.add((system, precision, stage))
                    runs.append(run)
                    what = (f"{run_tokens_per_s(run):,.0f} tokens/s, losses "
                            + ", ".join(f"{x:.6f}" for x in run["losses"][:3])
                            if run["status"] == "ok" else f"{run['status']}: {run.get('message', '')[:200]}")
                    print(f"[{i}/{n}] {name}: {what} ({wall:.0f} s, load {load:.1f})", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("bench_autoep: interrupted; reporting the runs finished so far", file=sys.stderr)
        return runs, True
    return runs, False


# -- aggregation and the table ---------------------------------------------------------------------------------
def aggregate(runs: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["precision"], r["stage"], r["system"]), []).append(r)
    rows = []
    for (precision, stage, system), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        row = {"precision": precision, "stage": stage, "system": system, "repeats": len(ok),
               "status": "ok" if ok else rs[0]["status"], "message": rs[0].get("message", "")}
        if ok:
            w = ok[0]["warmup"]
            tps = [run_tokens_per_s(r) for r in ok]
            row.update(
                tokens_per_s=statistics.median(tps), tokens_per_s_all=tps,
                step_s=statistics.median(statistics.median(r["step_s"][w:]) for r in ok),
                cpu_s=statistics.median(statistics.median(r["cpu_s"][w:]) for r in ok),
                peak_rss_mib=statistics.median(max(r["peak_rss_bytes"]) for r in ok) / MiB,
                rss_growth_mib=statistics.median(max(p - s for p, s in zip(r["peak_rss_bytes"], r["start_rss_bytes"]))
                                                 for r in ok) / MiB,
                losses=ok[0]["losses"][:3], first_losses=[r["losses"][0] for r in ok],
                n_params=ok[0]["n_params"], n_params_per_rank=max(ok[0]["n_params_per_rank"]),
                replaced=ok[0]["replaced"], launch_to_first_step_s=statistics.median(
                    r["launch_to_first_step_s"] for r in ok),
                versions={k: ok[0].get(k) for k in ("torch", "transformers", "deepspeed")})
            if len(ok) < len(rs):
                row["note"] = f"{len(rs) - len(ok)} of {len(rs)} repeats failed: " + next(
                    r for r in rs if r["status"] != "ok").get("message", "")[:150]
        rows.append(row)
    by = {(r["precision"], r["stage"], r["system"]): r for r in rows if r["status"] == "ok"}
    for row in rows:
        ds = by.get((row["precision"], row["stage"], "deepspeed"))
        if row["status"] == "ok" and row["system"] == "zerospeed" and ds:
            row["vs_ds"] = row["tokens_per_s"] / ds["tokens_per_s"]
            row["dloss_ds"] = [a - b for a, b in zip(row["losses"], ds["losses"])]
    rows.sort(key=lambda r: (("fp32", "bf16").index(r["precision"]), r["stage"], SYSTEMS.index(r["system"])))
    return rows


def _f(x, spec: str, none: str = "—") -> str:
    return none if x is None else format(x, spec)


HEADER = ("| precision | stage | system | step s (wall / CPU) | tokens/s (range) | zerospeed ÷ DeepSpeed | "
          "peak RSS/rank MiB (growth) | params/rank | launch→1st step s | losses, steps 1-3 | Δ vs DeepSpeed, "
          "steps 1-3 |")


def markdown_table(rows: list[dict]) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count(" | ") + 1)]
    for r in rows:
        head = f"| {r['precision']} | {r['stage']} | {LABEL[r['system']]} |"
        if r["status"] != "ok":
            msg = (r.get("message") or "failed").splitlines()[0][:200].replace("|", "/")
            lines.append(f"{head} {r['status']}: {msg} |" + " — |" * 7)
            continue
        lo, hi = min(r["tokens_per_s_all"]), max(r["tokens_per_s_all"])
        rng = f" ({lo:,.0f}-{hi:,.0f})" if len(r["tokens_per_s_all"]) > 1 else ""
        dl = ", ".join(f"{d:+.1e}" for d in r["dloss_ds"]) if r.get("dloss_ds") else "—"
        lines.append(
            f"{head} {r['step_s']:.3f} / {r['cpu_s']:.3f} | {r['tokens_per_s']:,.0f}{rng} | {_f(r.get('vs_ds'), '.3f')} "
            f"| {r['peak_rss_mib']:,.0f} (+{r['rss_growth_mib']:,.0f}) | {r['n_params_per_rank'] / 1e6:.2f}M | "
            f"{r['launch_to_first_step_s']:.1f} | {', '.join(f'{x:.6f}' for x in r['losses'])} | {dl} |")
    notes = [f"{LABEL[r['system']]} {r['precision']} stage {r['stage']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(lines + ([""] + notes if notes else []))


def targets_table(rows: list[dict]) -> str:
    lines = [f"| precision | stage | zerospeed ÷ DeepSpeed tokens/s (>= {TARGET:.2f}) |", "|---|---|---|"]
    for r in rows:
        if r["system"] == "zerospeed":
            v = r.get("vs_ds")
            lines.append(f"| {r['precision']} | {r['stage']} | "
                         f"{'—' if v is None else f'{v:.3f} ' + ('met' if v >= TARGET else 'missed')} |")
    return "\n".join(lines)


NOTES = ("tokens/s = global tokens per step (micro-batch x seq x 2 ranks) / median timed step (wall of the slowest rank: "
         "forward + backward + optimizer step), median over repeats (range: min-max over repeats); CPU = process CPU "
         "seconds per step (slowest rank), less sensitive to other jobs on the machine. Peak RSS: ru_maxrss of the "
         "larger rank (growth over its RSS once torch was imported and the process group up). params/rank: after "
         "AutoEP (each rank keeps its 8/ep experts of every MoE block). Losses: the model's loss (cross-entropy + "
         "router_aux_loss_coef x its load-balancing loss), mean over the 2 ranks; Δ = zerospeed - DeepSpeed. Both "
         "systems keep (zerospeed) or rebuild (DeepSpeed) the model's softmax top-2 router from the same weights, "
         "so the first-step losses agree to fp32 rounding in fp32.")


def _versions(saved: dict, system: str) -> str:
    v = saved.get("interpreters", {}).get(system) or {}
    return ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "deepspeed") if v.get(k)) or "n/a"


def report(saved: dict, base: Path) -> str:
    a, runs = saved["args"], saved["runs"]
    rows = aggregate(runs)
    loads = [r["load_avg_1min"] for r in runs if "load_avg_1min" in r]
    shape = next((r["shape"] for r in runs if "shape" in r), None)
    what = (f"{shape['layers']} layers x {shape['hidden']}, FFN {shape['intermediate']}, {shape['experts']} experts "
            f"top-{shape['top_k']}, vocab {shape['vocab']}, micro-batch {shape['micro_batch']} x seq {shape['seq']} per "
            f"rank" if shape else "")
    n_params = next((r["n_params"] for r in runs if "n_params" in r), None)
    header = (f"bench_autoep {saved['stamp']}: transformers MixtralForCausalLM, preset {a['preset']} ({what}"
              f"{f', {n_params / 1e6:.2f}M parameters' if n_params else ''}), AutoEP ep {a['ep']} = world size 2 (gloo, "
              f"1 thread per rank), expert_parallel {json.dumps(saved.get('expert_parallel'))}, {a['warmup']} warm-up + "
              f"{a['steps']} timed steps, {a['repeats']} interleaved repeat(s) (medians), AdamW lr 1e-4, no clipping; "
              f"zerospeed: {_versions(saved, 'zerospeed')} ({saved['zerospeed_source']}); DeepSpeed: "
              f"{_versions(saved, 'deepspeed')} ({saved.get('ds_python') or 'no --ds-python'}); {saved['cpu']}; 1-min "
              f"load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f}; "
              f"{saved['elapsed_s'] / 60:.1f} min in all.")
    md = f"{header}\n\n{markdown_table(rows)}\n\n{NOTES}\n\nTarget (issue 25):\n\n{targets_table(rows)}\n"
    if saved.get("interrupted"):
        md += "\nInterrupted: incomplete.\n"
    return write_results(base, md, saved, rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print(report(saved, Path(args.report).with_suffix("")))
        return 0
    signal.signal(signal.SIGTERM, raise_interrupt)  # like Ctrl-C: stop the launch, report what finished
    import shutil

    from _autoep_worker import EXPERT_PARALLEL, PRESETS
    from bench_zero import _cpu_name, write_batches, zerospeed_source

    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = Path(args.out)
    logs = out / f"logs_autoep_{stamp}"
    logs.mkdir(parents=True)
    pythons, interpreters = {}, {}
    if "zerospeed" in args.systems:
        pythons["zerospeed"] = sys.executable
        interpreters["zerospeed"], _ = probe_interpreter(sys.executable, "torch", "transformers")
    args.skip_reason = ""
    if "deepspeed" in args.systems:
        if not args.ds_python:
            args.skip_reason = (f"no --ds-python ({DEFAULT_DS_PYTHON} does not exist; see bench/README.md for the "
                                "virtualenv with deepspeed 0.19.8 + transformers 5.18)")
        else:
            interpreters["deepspeed"], why = probe_interpreter(args.ds_python, "torch", "transformers", "deepspeed")
            if interpreters["deepspeed"] is None:
                args.skip_reason = f"--ds-python cannot import deepspeed and transformers: {why}"
            else:
                pythons["deepspeed"] = args.ds_python
        if args.skip_reason:
            print(f"bench_autoep: DeepSpeed rows skipped: {args.skip_reason}", file=sys.stderr)
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="bench_autoep_"))
    try:
        shape = PRESETS[args.preset]
        data = tmp / "batches.pt"
        write_batches(data, world=2, steps=args.warmup + args.steps, micro=shape["micro_batch"], seq_len=shape["seq"],
                      seed=args.seed)
        pythonpath, source = zerospeed_source(args.zerospeed_ref, tmp / "zerospeed_ref")
        # the worker imports bench/_worker.py, which imports zerospeed.testing.models: the side interpreter finds
        # zerospeed through PYTHONPATH (the DeepSpeed runs use nothing else of it)
        pythonpath = pythonpath or str(HERE.parent / "src")
        n = len(args.precision) * len(args.stage) * args.repeats * len(pythons)
        print(f"bench_autoep: {n} launches of {args.warmup}+{args.steps} steps; zerospeed from {source}; logs in "
              f"{logs}", file=sys.stderr, flush=True)
        runs, interrupted = run_all(args, logs, data, pythons, pythonpath)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    saved = {"stamp": stamp, "args": vars(args), "elapsed_s": time.time() - t0, "cpu": _cpu_name(),
             "zerospeed_source": source, "ds_python": pythons.get("deepspeed"), "interpreters": interpreters,
             "expert_parallel": {**EXPERT_PARALLEL, "autoep_size": args.ep, **json.loads(args.expert_parallel)},
             "interrupted": interrupted, "runs": runs}
    print(report(saved, out / f"bench_autoep_{stamp}"))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
