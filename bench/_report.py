"""Aggregate benchmark runs into table rows, the markdown table and the chart (used by bench_zero.py).

A run is the dict a worker wrote plus what the parent added ("repeat", "load_avg", "wall_s").
Rows are per (model, precision, param groups, system, stage): medians over the repeats. A run without
"param_groups" (saved before issue 17) had one group with weight decay 0.0: it counts as 1.
"""
from __future__ import annotations

import statistics
from pathlib import Path

MiB = 2**20
LABEL = {"ddp": "DDP", "ddp_nocomm": "DDP, no all-reduce", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed",
         "zerospeed": "zerospeed", "zerospeed_before": "zerospeed before", "all": "all systems"}
# The ZeRO stage a non-ZeRO system corresponds to (what it holds per rank): for the formula and
# for the "vs DeepSpeed same stage" ratio.
EQUIVALENT_STAGE = {"ddp": 0, "ddp_nocomm": 0, "fsdp2": 3}
# Row order of the table and chart.
ORDER = ("ddp", "ddp_nocomm", "fsdp2", "deepspeed", "zerospeed", "zerospeed_before", "all")


def zero_formula_bytes(stage: int, precision: str, n_params: int, world: int) -> float:
    """Model-state bytes per rank (ZeRO paper; DESIGN.md "Measuring").

    bf16 (mixed precision, Adam): 2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master, m, v) bytes per
    parameter: stage 0 16Ψ, 1 4Ψ + 12Ψ/N, 2 2Ψ + 14Ψ/N, 3 16Ψ/N.
    fp32: 4 (params) + 4 (grads) + 8 (m, v), no master: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N.
    """
    p, n = float(n_params), float(world)
    if precision == "bf16":
        param, grad, opt = 2, 2, 12
    else:
        param, grad, opt = 4, 4, 8
    return {0: (param + grad + opt) * p,
            1: (param + grad) * p + opt * p / n,
            2: param * p + (grad + opt) * p / n,
            3: (param + grad + opt) * p / n}[stage]


def flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6Ψ (forward + backward matmuls) + 12·L·d·T for attention scores and
    their weighted sum (PaLM, Chowdhery et al. 2022, appendix B; causal masking not discounted)."""
    return 6.0 * n_params + 12.0 * n_layer * d_model * seq_len


def groups_of(run_or_row: dict) -> int:
    return run_or_row.get("param_groups", 1)


def system_label(system: str, param_groups: int, show_groups: bool) -> str:
    """The row label: 'zerospeed', or 'zerospeed (2 groups)' when the table holds both variants."""
    return LABEL[system] + (f" ({param_groups} group{'s' if param_groups != 1 else ''})" if show_groups else "")


def run_tokens_per_s(run: dict) -> float | None:
    if run.get("status") != "ok":
        return None
    timed = run["step_s"][run["warmup"]:]
    return run["micro_batch"] * run["seq_len"] * run["world_size"] / statistics.median(timed)


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=float("nan"))


def aggregate(runs: list[dict], *, peak_flops: float, model_shapes: dict[str, tuple[int, int, int]]) -> list[dict]:
    """One row per (model, precision, param groups, system, stage), in first-seen order, with medians
    over repeats; Δloss and the ratios against DDP / DeepSpeed of the same param groups.

    model_shapes: model name -> (n_layer, d_model, seq_len) for the FLOP count.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["model"], r["precision"], groups_of(r), r["system"], r["stage"]), []).append(r)
    ddp = {(r["model"], r["precision"], groups_of(r), r["repeat"]): r for r in runs
           if r["system"] == "ddp" and r.get("status") == "ok"}
    rows = []
    for (model, precision, pg, system, stage), rs in groups.items():
        row = {"model": model, "precision": precision, "param_groups": pg, "system": system, "stage": stage,
               "repeats": len(rs)}
        ok = [r for r in rs if r.get("status") == "ok"]
        if not ok:
            row["status"] = rs[0].get("status", "error")
            row["message"] = rs[0].get("message", "")
            rows.append(row)
            continue
        row["status"] = "ok"
        if len(ok) < len(rs):
            row["note"] = f"{len(rs) - len(ok)} of {len(rs)} repeats failed: {next(r for r in rs if r not in ok).get('message', '')}"
        tps = [run_tokens_per_s(r) for r in ok]
        row["tokens_per_s"] = statistics.median(tps)
        row["tokens_per_s_all"] = tps
        row["step_s_median"] = statistics.median(statistics.median(r["step_s"][r["warmup"]:]) for r in ok)
        row["cpu_s_median"] = statistics.median(statistics.median(r["cpu_s"][r["warmup"]:]) for r in ok)
        row["peak_rss_mib"] = statistics.median(max(r["peak_rss_bytes"]) for r in ok) / MiB
        # growth over the process's RSS before the model was built (torch imported, process group up)
        row["rss_growth_mib"] = statistics.median(max(p - s for p, s in zip(r["peak_rss_bytes"], r["start_rss_bytes"]))
                                                  for r in ok) / MiB if all("start_rss_bytes" in r for r in ok) else None
        row["state_bytes"] = max(max(r["state_bytes"]) for r in ok)
        row["state_breakdown"] = ok[0]["state_breakdown"][0]
        row["buffer_bytes"] = max(b.get("_buffers", 0) for r in ok for b in r["state_breakdown"])
        n_params = ok[0]["n_params"]
        row["n_params"] = n_params
        eq = EQUIVALENT_STAGE.get(system, stage)
        row["formula_bytes"] = zero_formula_bytes(eq, precision, n_params, ok[0]["world_size"])
        row["launch_to_first_step_s"] = statistics.median(r["launch_to_first_step_s"] for r in ok)
        diffs = [_max_abs_diff(r["losses"], ddp[(model, precision, pg, r["repeat"])]["losses"])
                 for r in ok if (model, precision, pg, r["repeat"]) in ddp]
        if system == "ddp":  # DDP against itself across repeats: its run-to-run nondeterminism
            ref = ok[0]["losses"]
            diffs = [_max_abs_diff(r["losses"], ref) for r in ok]
        elif system == "ddp_nocomm":  # each rank trains on its own gradients: not comparable
            diffs = []
        row["max_dloss"] = max(diffs) if diffs else None
        n_layer, d_model, seq = model_shapes[model]
        achieved = flops_per_token(n_params, n_layer, d_model, seq) * row["tokens_per_s"]
        row["mfu"] = achieved / (peak_flops * ok[0]["world_size"])
        row["final_loss"] = statistics.median(r["losses"][-1] for r in ok)
        rows.append(row)
    by_key = {(r["model"], r["precision"], r["param_groups"], r["system"], r["stage"]): r
              for r in rows if r["status"] == "ok"}
    for row in rows:
        if row["status"] != "ok":
            continue
        same = (row["model"], row["precision"], row["param_groups"])
        d = next((v for (m, p, g, s, _), v in by_key.items() if (m, p, g, s) == (*same, "ddp")), None)
        row["ratio_ddp"] = row["tokens_per_s"] / d["tokens_per_s"] if d else None
        eq = EQUIVALENT_STAGE.get(row["system"], row["stage"])
        ds = by_key.get((*same, "deepspeed", eq))
        row["ratio_ds"] = row["tokens_per_s"] / ds["tokens_per_s"] if ds and row["system"] != "deepspeed" else None
    return rows


def _x(ratio) -> str:
    return "" if ratio is None else "x"


def _fmt(x, spec: str, none: str = "—") -> str:
    return none if x is None else format(x, spec)


HEADER = ("| system | stage | precision | model | step s (wall / CPU) | tokens/s | vs DDP | vs DeepSpeed same stage | peak RSS/rank, MiB (growth after start) "
          "| model states/rank (MiB) vs formula | max \\|Δloss\\| vs DDP | launch→first step (s) | MFU |")


def markdown_table(rows: list[dict], by_groups: bool = False) -> str:
    """The table; `by_groups`: label each system with its param groups (a table holding both)."""
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in rows:
        stage = "-" if r["system"] in EQUIVALENT_STAGE or r["stage"] < 0 else str(r["stage"])
        label = system_label(r["system"], groups_of(r), by_groups and r["system"] != "all")
        head = f"| {label} | {stage} | {r['precision']} | {r['model']} |"
        if r["status"] == "skipped":
            lines.append(f"{head} skipped: {r.get('message', '')} |" + " |" * 8)
            continue
        if r["status"] == "not_implemented":
            msg = (r.get("message") or "").split(":")[0][:60].replace("|", "/")
            lines.append(f"{head} not implemented yet{' (' + msg + ')' if msg else ''} |" + " — |" * 8)
            continue
        if r["status"] != "ok":
            msg = (r.get("message") or "").splitlines()[0][:90] if r.get("message") else "failed"
            lines.append(f"{head} error: {msg.replace('|', '/')} |" + " — |" * 8)
            continue
        st, fm = r["state_bytes"] / MiB, r["formula_bytes"] / MiB
        dloss = r["max_dloss"]
        growth = f" (+{r['rss_growth_mib']:,.0f})" if r.get("rss_growth_mib") is not None else ""
        buf = f" + {r['buffer_bytes'] / MiB:,.0f} buffers" if r.get("buffer_bytes") else ""
        lines.append(
            f"{head} {r['step_s_median']:.2f} / {r['cpu_s_median']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{_fmt(r['ratio_ddp'], '.3f')}{_x(r['ratio_ddp'])} | {_fmt(r['ratio_ds'], '.3f')}{_x(r['ratio_ds'])} | {r['peak_rss_mib']:,.0f}{growth} | {st:,.1f} / {fm:,.1f} "
            f"({st / fm:.2f}x){buf} | {_fmt(dloss, '.1e')} | {r['launch_to_first_step_s']:.1f} | {100 * r['mfu']:.1f}% |")
    return "\n".join(lines)


AB_HEADER = ("| system | stage | precision | model | tokens/s, 2 groups ÷ 1 group | per repeat (paired) | CPU s/step, "
             "1 group ÷ 2 groups | model states/rank, MiB, 2 groups / 1 group | max \\|Δloss\\| vs DDP, 2 groups / "
             "1 group |")


def groups_ab_table(rows: list[dict], runs: list[dict]) -> str:
    """2 groups against 1 group per (model, precision, system, stage): the ratio of the median tokens/s,
    the ratios of the launches of the same repeat (run back to back), the ratio of the median CPU time
    per step (below 1: 2 groups slower in both), the model states and Δloss of each."""
    by = {(r["model"], r["precision"], r["system"], r["stage"], r["param_groups"]): r for r in rows
          if r["status"] == "ok"}
    tps = {(r["model"], r["precision"], r["system"], r["stage"], groups_of(r), r["repeat"]): run_tokens_per_s(r)
           for r in runs if r.get("status") == "ok"}
    lines = [AB_HEADER, "|" + "---|" * AB_HEADER.count(" | ") + "---|"]
    for r2 in rows:
        key = (r2["model"], r2["precision"], r2["system"], r2["stage"])
        if r2["status"] != "ok" or groups_of(r2) != 2 or (*key, 1) not in by:
            continue
        r1 = by[(*key, 1)]
        reps = sorted({k[-1] for k in tps if k[:4] == key})
        paired = [tps[(*key, 2, i)] / tps[(*key, 1, i)] for i in reps if (*key, 2, i) in tps and (*key, 1, i) in tps]
        stage = "-" if r2["system"] in EQUIVALENT_STAGE else str(r2["stage"])
        lines.append(
            f"| {LABEL[r2['system']]} | {stage} | {r2['precision']} | {r2['model']} | "
            f"{r2['tokens_per_s'] / r1['tokens_per_s']:.3f} | {', '.join(f'{x:.3f}' for x in paired)} | "
            f"{r1['cpu_s_median'] / r2['cpu_s_median']:.3f} | {r2['state_bytes'] / MiB:,.1f} / {r1['state_bytes'] / MiB:,.1f} | "
            f"{_fmt(r2['max_dloss'], '.1e')} / {_fmt(r1['max_dloss'], '.1e')} |")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path, title: str) -> Path | None:
    """Horizontal bars of tokens/s and peak RSS per rank, one pair of panels per (model, precision)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if r["status"] == "ok"]
    groups = list(dict.fromkeys((r["model"], r["precision"]) for r in ok))
    if not groups:
        return None
    colors = {"ddp": "#7f7f7f", "ddp_nocomm": "#c7c7c7", "fsdp2": "#ff7f0e", "deepspeed": "#1f77b4",
              "zerospeed": "#2ca02c", "zerospeed_before": "#98df8a"}
    n_max = max(sum(1 for r in ok if (r["model"], r["precision"]) == g) for g in groups)
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 0.45 * n_max * len(groups) + 1.5), squeeze=False)
    for (model, prec), (ax_t, ax_m) in zip(groups, axes):
        rs = [r for r in ok if (r["model"], r["precision"]) == (model, prec)]
        both = len({groups_of(r) for r in rs}) > 1
        labels = [system_label(r["system"], groups_of(r), both)
                  + ("" if r["system"] in EQUIVALENT_STAGE else f" stage {r['stage']}") for r in rs]
        ys = range(len(rs))
        c = [colors[r["system"]] for r in rs]
        tps = [r["tokens_per_s"] for r in rs]
        spread = [[t - min(r["tokens_per_s_all"]) for t, r in zip(tps, rs)],
                  [max(r["tokens_per_s_all"]) - t for t, r in zip(tps, rs)]]
        ax_t.barh(ys, tps, color=c, xerr=spread, error_kw={"elinewidth": 1, "capsize": 3, "ecolor": "#444"})
        ax_m.barh(ys, [r["peak_rss_mib"] for r in rs], color=c)
        for ax, key, end in ((ax_t, "tokens_per_s", lambda r: max(r["tokens_per_s_all"])),
                             (ax_m, "peak_rss_mib", lambda r: r["peak_rss_mib"])):
            ax.set_yticks(list(ys), labels)
            ax.invert_yaxis()
            for y, r in zip(ys, rs):  # the value right of the bar (and of its error bar)
                ax.text(end(r), y, f"  {r[key]:,.0f}", va="center", fontsize=8)
            ax.margins(x=0.15)
        ax_t.set_title(f"{model}, {prec}: tokens/s, median and range over repeats")
        ax_m.set_title(f"{model}, {prec}: peak RSS per rank, MiB (lower is better)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results(base: Path, md: str, saved: dict, rows: list[dict]) -> str:
    """Write a benchmark's table (`base`.md) and its runs and rows (`base`.json, for `--report`); returns md."""
    import json
    import sys

    base.with_suffix(".md").write_text(md)
    base.with_suffix(".json").write_text(json.dumps({**saved, "rows": rows}, indent=1, default=str))
    print(f"written: {base}.md, {base}.json", file=sys.stderr)
    return md


def raise_interrupt(signum, frame):
    """A SIGTERM handler that stops a benchmark like Ctrl-C (the launch is killed, what finished is reported)."""
    import signal

    raise KeyboardInterrupt(signal.Signals(signum).name)
