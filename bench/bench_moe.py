"""Mixture of experts (issue 25), the MoE layer: zerospeed's `MoE` against DeepSpeed's and the dense model of
equal active compute, in one run, on the same model, weights, data, seed and machine.

    python bench/bench_moe.py                                                   # the full grid (see bench/README.md)
    python bench/bench_moe.py --model tiny --experts 4 --k 1 --precision fp32 --steps 3 --warmup 1   # a quick look
    python bench/bench_moe.py --report bench/results/bench_moe_<stamp>.json    # re-render a saved run

The model (`_moe_worker.py`): the GPT of `zerospeed.testing.models` (`small`: 6 x 384, seq 256; `tiny`: 2 x 64,
seq 64) with every other block's MLP (blocks 1, 3, 5) an MoE layer of E experts, each the block's MLP (d -> 4d
-> d), top-k routing, expert parallelism 2 (world size 2: each rank holds E/2 experts), use_rts=False; loss =
cross-entropy + 0.01 x sum of l_aux. Per (E, k, precision), each its own torchrun launch:

    zerospeed cf 1.25   zerospeed.moe.layer.MoE(capacity_factor=1.25, drop_tokens=True)
    zerospeed dropless  the same with drop_tokens=False
    DeepSpeed cf 1.25   deepspeed.moe.layer.MoE with the same arguments (deepspeed.initialize, torch AdamW)
    DeepSpeed dropless  the same with drop_tokens=False
    dense (per k)       zerospeed, the same GPT with those blocks' MLPs k x 4d wide: the compute a token meets
                        in top-k routing (k experts of width 4d), no router, no all-to-all

ZeRO stage `--stage` (0) in both systems, AdamW lr 3e-4 over two parameter groups (weight decay 0.1 on ndim >= 2,
0.0 on the rest, as bench_zero), no clipping, `"bf16": {"enabled": true}` for bf16; gloo, 1 thread per rank.
Repeats are interleaved (each repeat starts one configuration later); the table shows medians.
Writes bench/results/bench_moe_<stamp>.{md,json} and the launch logs under bench/results/logs_moe_<stamp>/.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import raise_interrupt, write_results  # noqa: E402

MiB = 2**20
TINY_OR_SMALL = ("tiny", "small")
# (system, drop_tokens) of the MoE rows, in table order; "dense" has one row per (k, precision)
MOE_VARIANTS = (("zerospeed", True), ("deepspeed", True), ("zerospeed", False), ("deepspeed", False))
LABEL = {"zerospeed": "zerospeed", "deepspeed": "DeepSpeed", "dense": "dense (zerospeed)"}


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _strs(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return items
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=_ints, default=[4, 8], help="comma list of expert counts (default 4,8)")
    p.add_argument("--k", type=_ints, default=[1, 2], help="comma list of top-k (default 1,2)")
    p.add_argument("--precision", type=_strs(("fp32", "bf16")), default=["fp32", "bf16"],
                   help="comma list (default fp32,bf16)")
    p.add_argument("--systems", type=_strs(("zerospeed", "deepspeed", "dense")),
                   default=["zerospeed", "deepspeed", "dense"], help="comma list (default all three)")
    p.add_argument("--routing", type=_strs(("cf", "dropless")), default=["cf", "dropless"],
                   help="cf: capacity factor --capacity-factor, drop_tokens=True; dropless: drop_tokens=False")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--model", choices=TINY_OR_SMALL, default="small")
    p.add_argument("--stage", type=int, choices=(0, 1, 2), default=0, help="zero_optimization.stage (both systems)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per launch (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per launch (at least 1)")
    p.add_argument("--repeats", type=int, default=1, help="launches per configuration, interleaved")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per launch before it is killed (default 120 + 10 s (tiny) / 60 s (small) per step)")
    p.add_argument("--zerospeed-ref", metavar="GIT_REF", default=None,
                   help="benchmark zerospeed as committed at GIT_REF (see bench_zero.py) instead of the working tree")
    p.add_argument("--report", metavar="JSON", default=None, help="re-render a saved bench_moe_<stamp>.json")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")
    if any(e % 2 for e in args.experts) or any(k < 1 or k > min(args.experts) for k in args.k):
        p.error("--experts must be even (ep_size 2) and every --k between 1 and the smallest expert count")
    return args


def configurations(args) -> list[tuple]:
    """(system, experts, k, drop_tokens) per launch of one precision and repeat, in table order."""
    drops = [r == "cf" for r in args.routing]
    out = []
    for k in args.k:
        if "dense" in args.systems:
            out.append(("dense", 0, k, True))
        for e in args.experts:
            out.extend((s, e, k, d) for s, d in MOE_VARIANTS if s in args.systems and d in drops)
    return out


def _name(system: str, experts: int, k: int, drop: bool) -> str:
    if system == "dense":
        return f"dense_k{k}"
    return f"{system}_E{experts}_k{k}_{'cf' if drop else 'dropless'}"


def run_all(args, logs: Path, data: Path, pythonpath: str | None) -> tuple[list[dict], bool]:
    from bench_zero import _log_tail, launch

    configs = configurations(args)
    total_steps = args.warmup + args.steps
    timeout = args.timeout or 120 + (10 if args.model == "tiny" else 60) * total_steps
    runs, failed, n, i = [], set(), len(configs) * len(args.precision) * args.repeats, 0
    try:
        for precision in args.precision:
            for rep in range(args.repeats):
                order = configs[rep % len(configs):] + configs[:rep % len(configs)]
                for system, experts, k, drop in order:
                    i += 1
                    key = (precision, system, experts, k, drop)
                    name = f"{precision}_{_name(system, experts, k, drop)}_r{rep}"
                    if system == "deepspeed" and key in failed:  # a DeepSpeed refusal does not change: launched once
                        print(f"[{i}/{n}] {name}: failed in an earlier repeat, not relaunched", file=sys.stderr, flush=True)
                        continue
                    result = data.parent / f"{name}.json"
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(HERE / "_moe_worker.py"), "--system", system, "--experts", str(experts), "--k", str(k),
                           "--capacity-factor", str(args.capacity_factor), "--drop-tokens", str(int(drop)),
                           "--stage", str(args.stage), "--precision", precision, "--model", args.model,
                           "--steps", str(args.steps), "--warmup", str(args.warmup),
                           "--micro-batch", str(args.micro_batch), "--seed", str(args.seed), "--data", str(data),
                           "--result", str(result), "--launch-time", str(time.time())]
                    load = os.getloadavg()[0]
                    code, wall = launch(cmd, logs / f"{name}.log", timeout, pythonpath if system != "deepspeed" else None)
                    if result.exists():
                        run = json.loads(result.read_text())
                    else:
                        why = "timed out" if code is None else f"exit code {code}"
                        run = {"status": "error", "message": f"{why}: {_log_tail(logs / f'{name}.log')}"}
                    run.update(system=system, experts=experts, k=k, drop_tokens=drop, precision=precision, repeat=rep,
                               load_avg_1min=load, wall_s=wall)
                    if run["status"] != "ok":
                        failed.add(key)
                    runs.append(run)
                    what = (f"{tokens_per_s(run):,.0f} tokens/s, first loss {run['losses'][0]:.6f}"
                            if run["status"] == "ok" else f"{run['status']}: {run.get('message', '')[:150]}")
                    print(f"[{i}/{n}] {name}: {what} ({wall:.0f} s, load {load:.1f})", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("bench_moe: interrupted; reporting the runs finished so far", file=sys.stderr)
        return runs, True
    return runs, False


# -- aggregation and the table ---------------------------------------------------------------------------
def tokens_per_s(run: dict) -> float:
    """Global tokens per step (micro x seq x world) / median timed step (slowest rank)."""
    return run["micro_batch"] * run["seq_len"] * run["world_size"] / statistics.median(run["step_s"][run["warmup"]:])


def aggregate(runs: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["precision"], r["system"], r["experts"], r["k"], r["drop_tokens"]), []).append(r)
    rows = []
    for (precision, system, experts, k, drop), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        row = {"precision": precision, "system": system, "experts": experts, "k": k, "drop_tokens": drop,
               "repeats": len(ok), "status": "ok" if ok else rs[0]["status"], "message": rs[0].get("message", "")}
        if ok:
            w = ok[0]["warmup"]
            row.update(
                tokens_per_s=statistics.median(tokens_per_s(r) for r in ok),
                tokens_per_s_all=[tokens_per_s(r) for r in ok],
                step_s=statistics.median(statistics.median(r["step_s"][w:]) for r in ok),
                cpu_s=statistics.median(statistics.median(r["cpu_s"][w:]) for r in ok),
                a2a_s=statistics.median(statistics.median(r["a2a_s"][w:]) for r in ok),
                a2a_calls=ok[0]["a2a_calls_per_step"],
                peak_rss_mib=statistics.median(max(r["peak_rss_bytes"]) for r in ok) / MiB,
                rss_growth_mib=statistics.median(max(p - s for p, s in zip(r["peak_rss_bytes"], r["start_rss_bytes"]))
                                                 for r in ok) / MiB,
                dropped=(sum(r["dropped_routes"] for r in ok) / sum(r["routes"] for r in ok)
                         if sum(r["routes"] for r in ok) else None),
                first_loss=ok[0]["losses"][0], first_losses=[r["losses"][0] for r in ok],
                n_params_per_rank=ok[0]["n_params_per_rank"], launch_to_first_step_s=statistics.median(
                    r["launch_to_first_step_s"] for r in ok))
            loads = [r for r in ok if r.get("expert_rows_max")]
            if loads:  # the busier rank's expert rows per step, and one expert's time per row (since session 35)
                row["expert_rows_max"] = statistics.median(statistics.median(r["expert_rows_max"][w:]) for r in loads)
                row["expert_rows_mean"] = statistics.median(statistics.median(r["expert_rows_mean"][w:]) for r in loads)
                secs = [r["expert_row_s"] for r in loads if r.get("expert_row_s")]
                row["expert_row_s"] = statistics.median(secs) if secs else None
            if len(ok) < len(rs):
                row["note"] = f"{len(rs) - len(ok)} of {len(rs)} repeats failed"
        rows.append(row)
    by = {(r["precision"], r["system"], r["experts"], r["k"], r["drop_tokens"]): r for r in rows if r["status"] == "ok"}
    for row in rows:
        if row["status"] != "ok":
            continue
        p, s, e, k, d = row["precision"], row["system"], row["experts"], row["k"], row["drop_tokens"]
        ds, dense, cf = by.get((p, "deepspeed", e, k, d)), by.get((p, "dense", 0, k, True)), by.get((p, s, e, k, True))
        row["vs_ds"] = row["tokens_per_s"] / ds["tokens_per_s"] if ds and s == "zerospeed" else None
        row["dloss_ds"] = row["first_loss"] - ds["first_loss"] if ds and s == "zerospeed" else None
        row["dropless_vs_cf"] = row["tokens_per_s"] / cf["tokens_per_s"] if cf and not d and s != "dense" else None
        row["vs_dense"] = row["step_s"] / dense["step_s"] if dense and s != "dense" else None
    order = {"dense": 0, "zerospeed": 1, "deepspeed": 2}
    rows.sort(key=lambda r: (("fp32", "bf16").index(r["precision"]), r["k"], r["experts"], not r["drop_tokens"],
                             order[r["system"]]))
    return rows


def _f(x, spec: str, none: str = "—") -> str:
    return none if x is None else format(x, spec)


HEADER = ("| precision | E | k | system | routing | step s (wall / CPU) | tokens/s | zerospeed ÷ DeepSpeed | dropless ÷ "
          "cf | step ÷ dense | peak RSS/rank MiB (growth) | all-to-all s/step (calls) | dropped % | first-step loss "
          "(Δ vs DeepSpeed) |")


def markdown_table(rows: list[dict], cf: float) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in rows:
        dense = r["system"] == "dense"
        routing = f"MLP {r['k']} x 4d" if dense else (f"cf {cf:g}" if r["drop_tokens"] else "dropless")
        head = f"| {r['precision']} | {'—' if dense else r['experts']} | {r['k']} | {LABEL[r['system']]} | {routing} |"
        if r["status"] != "ok":
            msg = (r.get("message") or "failed").splitlines()[0][:140].replace("|", "/")
            lines.append(f"{head} {r['status']}: {msg} |" + " — |" * 8)
            continue
        dl = f" ({r['dloss_ds']:+.1e})" if r.get("dloss_ds") is not None else ""
        a2a = "—" if dense else f"{r['a2a_s']:.3f} ({r['a2a_calls']})"
        lines.append(
            f"{head} {r['step_s']:.3f} / {r['cpu_s']:.3f} | {r['tokens_per_s']:,.0f} | {_f(r['vs_ds'], '.3f')} | "
            f"{_f(r['dropless_vs_cf'], '.3f')} | {_f(r['vs_dense'], '.3f')} | {r['peak_rss_mib']:,.0f} "
            f"(+{r['rss_growth_mib']:,.0f}) | {a2a} | {_f(None if dense else 100 * r['dropped'], '.2f')} | "
            f"{r['first_loss']:.6f}{dl} |")
    return "\n".join(lines)


def dropless_limit(cf_row: dict, dropless_row: dict) -> tuple[float, float, float] | None:
    """(the largest dropless ÷ cf tokens/s this routing allows, the extra rows, seconds per row): dropless computes
    every route, so the busier rank's experts take the rows the capacity cut dropped on top of the cf step -
    `expert_rows_max` dropless less cf, each at one expert's own forward + backward time per row, measured alone
    (`expert_row_s`): cf step / (cf step + extra rows x row time). The experts stay on their ranks, so no dropless
    implementation does less on the busier rank."""
    extra = (dropless_row.get("expert_rows_max") or 0) - (cf_row.get("expert_rows_max") or 0)
    row_s = dropless_row.get("expert_row_s") or cf_row.get("expert_row_s")
    if not cf_row.get("expert_rows_max") or not dropless_row.get("expert_rows_max") or not row_s:
        return None
    return cf_row["step_s"] / (cf_row["step_s"] + extra * row_s), extra, row_s


def targets_table(rows: list[dict], cf: float) -> str:
    """The issue's three targets per (precision, E, k), from zerospeed's rows."""
    by = {(r["precision"], r["system"], r["experts"], r["k"], r["drop_tokens"]): r for r in rows if r["status"] == "ok"}
    head = (f"| precision | E | k | zerospeed ÷ DeepSpeed tokens/s, cf {cf:g} (>= 1.10) | dropless ÷ cf {cf:g} tokens/s "
            f"(>= 0.90) | MoE cf {cf:g} ÷ dense step time (<= 1.30) |")
    lines = [head, "|---|---|---|---|---|---|"]

    def cell(x, ok):
        return "—" if x is None else f"{x:.3f} {'met' if ok(x) else 'missed'}"

    for (p, s, e, k, d), r in by.items():
        if s != "zerospeed" or not d:
            continue
        dropless = by.get((p, s, e, k, False))
        lim = dropless_limit(r, dropless) if dropless else None
        why = (f" (limit {lim[0]:.3f}: {lim[1]:+,.0f} expert rows per step on the busier rank at "
               f"{lim[2] * 1e6:.0f} us each)" if lim else "")
        lines.append(f"| {p} | {e} | {k} | {cell(r['vs_ds'], lambda x: x >= 1.10)} | "
                     f"{cell(dropless and dropless['dropless_vs_cf'], lambda x: x >= 0.90)}{why} | "
                     f"{cell(r['vs_dense'], lambda x: x <= 1.30)} |")
    return "\n".join(lines)


NOTES = ("tokens/s = global tokens per step (micro-batch x seq x 2 ranks) / median timed step (wall, slowest rank; "
         "forward + backward + optimizer step); CPU = process CPU time per step, less sensitive to other jobs. "
         "zerospeed ÷ DeepSpeed: tokens/s, same E, k, routing, precision; dropless ÷ cf: tokens/s of the same system; "
         "step ÷ dense: step time over the dense model's of the same k and precision (MLPs k x 4d: the same matmul "
         "FLOPs per token as top-k routing, at cf 1.25 plus up to 25% padding slots). Peak RSS: ru_maxrss of the larger "
         "rank (growth over the RSS once torch was imported and the process group up). All-to-all s/step: median over "
         "timed steps of the slowest rank's seconds in all-to-all, with the calls per step: zerospeed from its comms "
         "logger (\"all_to_all\", start to finish; the dropless path's exchange of expert counts is not logged), "
         "DeepSpeed by timing torch.distributed.all_to_all_single around each call in the worker (its calls are "
         "blocking). Dropped %: routes over capacity / all routes (k x tokens), every MoE layer, rank and step, from "
         "exp_counts (routes asked per expert before the cut) and C = max(ceil(S/E x k x cf), 4). First-step loss: "
         "mean over ranks; Δ = zerospeed - DeepSpeed, same weights, data and routing.")


def report(saved: dict, base: Path) -> str:
    a, runs = saved["args"], saved["runs"]
    rows = aggregate(runs)
    loads = [r["load_avg_1min"] for r in runs]
    seq = next((r["seq_len"] for r in runs if "seq_len" in r), "?")
    header = (f"bench_moe {saved['stamp']}: GPT {a['model']} with an MoE MLP in every other block, ep 2 = world size 2 "
              f"(gloo, 1 thread per rank), ZeRO stage {a['stage']}, micro-batch {a['micro_batch']} x seq {seq} per rank, "
              f"{a['warmup']} warm-up + {a['steps']} timed steps, {a['repeats']} interleaved repeat(s) (medians), AdamW "
              f"lr 3e-4 (2 groups), no clipping, l_aux coefficient 0.01, use_rts=False"
              f"; torch {saved['torch']}, deepspeed {saved.get('deepspeed') or 'n/a'}, {saved['cpu']}; 1-min load "
              f"average {min(loads, default=0):.1f}-{max(loads, default=0):.1f}; {saved['elapsed_s'] / 60:.1f} min in "
              f"all. zerospeed: {saved['zerospeed_source']}.")
    md = (f"{header}\n\n{markdown_table(rows, a['capacity_factor'])}\n\n{NOTES}\n\n"
          f"Targets (issue 25), zerospeed's rows:\n\n{targets_table(rows, a['capacity_factor'])}\n")
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

    import torch

    from bench_zero import _cpu_name, write_batches, zerospeed_source
    from zerospeed.testing.models import GPT_SIZES

    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = Path(args.out)
    logs = out / f"logs_moe_{stamp}"
    logs.mkdir(parents=True)
    ds_version = None
    if "deepspeed" in args.systems:
        if importlib.util.find_spec("deepspeed") is None:
            print("bench_moe: deepspeed is not importable: its rows are left out "
                  "(DS_BUILD_OPS=0 pip install deepspeed==0.19.8 to compare)", file=sys.stderr)
            args.systems = [s for s in args.systems if s != "deepspeed"]
        else:
            from importlib.metadata import version

            ds_version = version("deepspeed")
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="bench_moe_"))
    try:
        data = tmp / "batches.pt"
        write_batches(data, world=2, steps=args.warmup + args.steps, micro=args.micro_batch,
                      seq_len=GPT_SIZES[args.model].seq_len, seed=args.seed)
        pythonpath, source = zerospeed_source(args.zerospeed_ref, tmp / "zerospeed_ref")
        n = len(configurations(args)) * len(args.precision) * args.repeats
        print(f"bench_moe: {n} launches of {args.warmup}+{args.steps} steps; zerospeed from {source}; logs in {logs}",
              file=sys.stderr, flush=True)
        runs, interrupted = run_all(args, logs, data, pythonpath)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    saved = {"stamp": stamp, "args": vars(args), "elapsed_s": time.time() - t0, "torch": torch.__version__,
             "deepspeed": ds_version, "cpu": _cpu_name(), "zerospeed_source": source, "interrupted": interrupted,
             "runs": runs}
    print(report(saved, out / f"bench_moe_{stamp}"))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
