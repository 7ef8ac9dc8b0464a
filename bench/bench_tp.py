"""Tensor parallelism (AutoTP) against data parallelism and one process, and DeepSpeed's AutoTP, in one run.

    python bench/bench_tp.py                                     # the table of bench/README.md (session 11)
    python bench/bench_tp.py --size small --steps 2 --warmup 1 --repeats 1 --models llama   # a quick look
    python bench/bench_tp.py --report bench/results/bench_tp_<stamp>.json                   # re-render

Models: unmodified Hugging Face models built from a config (no download), the shape of bench_zero.py's
GPT sizes (`base`: 12 layers x 768, 12 heads, 256 positions, byte vocabulary 256; `small`: 6 x 384):
`gpt2` = GPT2LMHeadModel (Conv1D, fused q|k|v, tied embeddings, MLP 4d), `llama` = LlamaForCausalLM
(separate q/k/v/o, gate/up/down with MLP width 8d/3 = 2048, so both have ~85M parameters at base; 12
key/value heads, untied lm_head). Configurations, each its own torchrun launch (world 2 unless noted):

    one process    zerospeed, world 1, ZeRO 0 (the reference: Δloss and the model-state ratio)
    dp 2           zerospeed, ZeRO 0 and 3, each rank its own micro-batch
    tp 2           zerospeed, "tensor_parallel": {"autotp_size": 2}, ZeRO 0 and 3; both ranks see one micro-batch
    DeepSpeed tp 2 deepspeed 0.19.8, the same config (AutoTP training), ZeRO 0 and 3 (it refuses GPT-2: run once)

Every rank trains `warmup + steps` steps of micro-batch `--micro-batch` windows of the demo text (the
replica r = rank // tp reads the windows bench_zero.py's rank r would), AdamW lr 3e-4 (one group, weight
decay 0), no clipping, fp32, OMP_NUM_THREADS=1. Repeats are interleaved (each repeat starts one
configuration later); the table shows medians. The comms logger (zerospeed's; DeepSpeed's
`comms_logger`) gives the seconds spent in all-reduce per timed step. Model states per rank: zerospeed's
`engine.strategy.memory_breakdown()` sum after the last backward (before its step); DeepSpeed's by the
tensor walk of bench/_systems.py. Writes bench/results/bench_tp_<stamp>.{md,json} and logs_tp_<stamp>/.

The worker is this file too (`--worker`, started by torchrun); not collected by pytest.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MiB = 2**20
SIZES = {"small": dict(n_layer=6, d=384, heads=6, seq=256), "base": dict(n_layer=12, d=768, heads=12, seq=256)}
ADAM = {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
# (name, system, tp, world, stage)
CONFIGS = [("one process", "zerospeed", 1, 1, 0),
           ("dp 2", "zerospeed", 1, 2, 0), ("dp 2", "zerospeed", 1, 2, 3),
           ("tp 2", "zerospeed", 2, 2, 0), ("tp 2", "zerospeed", 2, 2, 3),
           ("DeepSpeed tp 2", "deepspeed", 2, 2, 0), ("DeepSpeed tp 2", "deepspeed", 2, 2, 3)]


# -- models ---------------------------------------------------------------------------------------------
def build_model(kind: str, size: str, seed: int):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    s = SIZES[size]
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=s["seq"], n_embd=s["d"], n_layer=s["n_layer"],
                                      n_head=s["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=s["d"], intermediate_size=8 * s["d"] // 3,
                                   num_hidden_layers=s["n_layer"], num_attention_heads=s["heads"],
                                   num_key_value_heads=s["heads"], max_position_embeddings=s["seq"],
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


# -- worker (one rank of one launch) --------------------------------------------------------------------
def _config(micro: int, stage: int, tp: int, deepspeed: bool) -> dict:
    adam = dict(ADAM, torch_adam=True) if deepspeed else dict(ADAM)
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": adam}, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
           "comms_logger": {"enabled": True, "verbose": False, "prof_all": True}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


class _Runner:
    def __init__(self, args, model):
        self.system = args.system
        cfg = _config(args.micro_batch, args.stage, args.tp, args.system == "deepspeed")
        if args.system == "deepspeed":
            import logging

            import deepspeed

            deepspeed.utils.logger.setLevel(logging.WARNING)
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
        else:
            import zerospeed

            self.engine, *_ = zerospeed.initialize(model=model, config=cfg)

    def forward_backward(self, x):
        loss = self.engine(input_ids=x, labels=x).loss
        self.engine.backward(loss)
        return loss

    def step(self):
        self.engine.step()

    def reset_comms(self):
        if self.system == "deepspeed":
            self._ds_base = self._ds_cumulative()
        else:
            self.engine.comms_logger.reset()

    @staticmethod
    def _ds_cumulative() -> dict[str, float]:
        """DeepSpeed 0.19.8's comms logger appends `timers(name).elapsed(reset=False)` per call: the running
        total of that op's timer, not the call's latency (summing its records counts early calls again and
        again). The timer's total (ms) is the truth: read it, per logged name, and take differences."""
        from deepspeed.comm import comm as dcomm

        return {name: dcomm.timers(name).elapsed(reset=False) / 1e3 for name in dcomm.comms_logger.comms_dict}

    def comm_seconds(self) -> dict[str, float]:
        """Seconds per collective name since `reset_comms` (DeepSpeed: its comm timers, `_ds_cumulative`)."""
        if self.system == "deepspeed":
            out = {}
            for name, total in self._ds_cumulative().items():
                key = "all_reduce" if "all_reduce" in name else name
                out[key] = out.get(key, 0.0) + total - self._ds_base.get(name, 0.0)
            return out
        return {k: v.seconds for k, v in self.engine.comms_logger.stats.items()}

    def state_bytes(self) -> int:
        if self.system == "deepspeed":
            from _systems import HeldTensors

            held = HeldTensors()
            params = list(self.engine.module.parameters())
            for p in params:
                held.add_tensor("params", p)
                for v in vars(p).values():
                    held.add_tensor("params", v)
            for p in params:
                if p.grad is not None:
                    held.add_tensor("grads", p.grad)
            held.walk("optimizer", self.engine.optimizer)
            return sum(v for k, v in held.by_category.items() if not k.startswith("_"))
        return sum(self.engine.strategy.memory_breakdown().values())


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from _systems import all_gather_floats

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    meta = {k: getattr(args, k) for k in ("name", "system", "model", "size", "tp", "stage", "steps", "warmup",
                                          "micro_batch", "repeat")}
    meta["world_size"] = world
    try:
        seq = SIZES[args.size]["seq"]
        replica = rank // args.tp
        batches = torch.load(args.data, weights_only=True)
        mine = batches[replica, :args.warmup + args.steps, :args.micro_batch, :seq].long().clone()
        del batches
        model = build_model(args.model, args.size, args.seed)
        n_params = sum(p.numel() for p in model.parameters())
        runner = _Runner(args, model)
        total = args.warmup + args.steps
        step_s, losses, ar_s, comm_s, state = [], [], [], [], 0
        for i in range(total):
            runner.reset_comms()
            t0 = time.perf_counter()
            loss = runner.forward_backward(mine[i])
            t1 = time.perf_counter()
            if i == total - 1:
                state = runner.state_bytes()
            t2 = time.perf_counter()
            runner.step()
            t3 = time.perf_counter()
            step_s.append((t1 - t0) + (t3 - t2))
            secs = runner.comm_seconds()
            ar_s.append(secs.get("all_reduce", 0.0))
            comm_s.append(sum(secs.values()))
            losses.append(float(loss.detach().float()))
        times, ars, comms, loss_ranks = (all_gather_floats(v) for v in (step_s, ar_s, comm_s, losses))
        per_rank = all_gather_floats([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, float(state)])
        result = {"status": "ok", "n_params": n_params,
                  "step_s": [max(r[i] for r in times) for i in range(total)],
                  "all_reduce_s": [max(r[i] for r in ars) for i in range(total)],
                  "comm_s": [max(r[i] for r in comms) for i in range(total)],
                  # the mean over the data-parallel replicas (tensor-parallel ranks of one replica agree)
                  "losses": [sum(r[i] for r in loss_ranks) / world for i in range(total)],
                  "peak_rss_bytes": [r[0] for r in per_rank], "state_bytes": [r[1] for r in per_rank]}
        code = 0
    except Exception as e:  # noqa: BLE001 - a refusal or failure is a table row
        result = {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(result["traceback"], file=sys.stderr, flush=True)
        code = 1
    if rank == 0:
        tmp = Path(args.result).with_suffix(".tmp")
        tmp.write_text(json.dumps({**meta, **result}))
        tmp.replace(args.result)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return code


# -- parent ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2,llama", help="comma list of gpt2, llama")
    p.add_argument("--size", choices=sorted(SIZES), default="base")
    p.add_argument("--steps", type=int, default=3, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per data-parallel replica per step")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--systems", default="zerospeed,deepspeed", help="comma list of zerospeed, deepspeed")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--report", metavar="JSON", default=None, help="re-render a saved bench_tp_<stamp>.json")
    # worker side
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--name", "--system", "--model", "--data", "--result"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--tp", "--stage", "--repeat"):
        p.add_argument(flag, type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")
    return args


def run_all(args, logs: Path, data: Path) -> list[dict]:
    from bench_zero import _log_tail, launch

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    systems = {s.strip() for s in args.systems.split(",")}
    configs = [(m, *c) for m in models for c in CONFIGS if c[1] in systems]
    runs, refused, k = [], set(), 0
    n = len(configs) * args.repeats
    for rep in range(args.repeats):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        for model, name, system, tp, world, stage in order:
            k += 1
            key = (model, system, stage)
            if key in refused:  # a refusal does not change between repeats: launched once
                print(f"[{k}/{n}] {model} {name} ZeRO {stage}: refused in an earlier repeat, not relaunched",
                      file=sys.stderr, flush=True)
                continue
            tag = f"{model}_{name.replace(' ', '')}_s{stage}_r{rep}"
            result = data.parent / f"{tag}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                   str(Path(__file__).resolve()), "--worker", "--name", name, "--system", system, "--model", model,
                   "--size", args.size, "--tp", str(tp), "--stage", str(stage), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch), "--seed", str(args.seed),
                   "--repeat", str(rep), "--data", str(data), "--result", str(result)]
            load = os.getloadavg()[0]
            code, wall = launch(cmd, logs / f"{tag}.log", args.timeout)
            if result.exists():
                run = json.loads(result.read_text())
            else:
                why = "timed out" if code is None else f"exit code {code}"
                run = {"status": "error", "message": f"{why}: {_log_tail(logs / f'{tag}.log')}"}
            run.update(name=name, system=system, model=model, tp=tp, world_size=world, stage=stage, repeat=rep,
                       load_avg_1min=load, wall_s=wall)
            if run["status"] != "ok" and system == "deepspeed":
                run["status"] = "refused"
                refused.add(key)
            runs.append(run)
            what = (f"{tokens_per_s(run, args.micro_batch, SIZES[args.size]['seq']):,.0f} tokens/s"
                    if run["status"] == "ok" else f"{run['status']}: {run.get('message', '')[:150]}")
            print(f"[{k}/{n}] {model} {name} ZeRO {stage} repeat {rep + 1}: {what} ({wall:.0f} s, load {load:.1f})",
                  file=sys.stderr, flush=True)
    return runs


def tokens_per_s(run: dict, micro: int, seq: int) -> float:
    """Global tokens per step (micro x seq x data-parallel replicas) / median timed step (slowest rank)."""
    replicas = run["world_size"] // run["tp"] if run["tp"] else run["world_size"]
    return micro * seq * replicas / statistics.median(run["step_s"][run["warmup"]:])


def aggregate(runs: list[dict], micro: int, seq: int) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["model"], r["name"], r["stage"]), []).append(r)
    rows = []
    for (model, name, stage), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        row = {"model": model, "name": name, "stage": stage, "repeats": len(ok), "status": "ok" if ok else rs[0]["status"],
               "message": rs[0].get("message", "")}
        if ok:
            w = ok[0]["warmup"]
            row.update(
                n_params=ok[0]["n_params"],
                tokens_per_s=statistics.median(tokens_per_s(r, micro, seq) for r in ok),
                tokens_per_s_all=[tokens_per_s(r, micro, seq) for r in ok],
                step_s=statistics.median(statistics.median(r["step_s"][w:]) for r in ok),
                all_reduce_s=statistics.median(statistics.median(r["all_reduce_s"][w:]) for r in ok),
                comm_s=statistics.median(statistics.median(r["comm_s"][w:]) for r in ok),
                peak_rss_mib=statistics.median(max(r["peak_rss_bytes"]) for r in ok) / MiB,
                state_bytes=max(max(r["state_bytes"]) for r in ok),
                losses=ok[0]["losses"], tp=ok[0]["tp"],
                tps_by_repeat={r["repeat"]: tokens_per_s(r, micro, seq) for r in ok})
        rows.append(row)
    by = {(r["model"], r["name"], r["stage"]): r for r in rows if r["status"] == "ok"}
    for row in rows:
        if row["status"] != "ok":
            continue
        one = by.get((row["model"], "one process", 0))
        dp = by.get((row["model"], "dp 2", row["stage"]))
        ds = by.get((row["model"], "DeepSpeed tp 2", row["stage"]))
        tp = by.get((row["model"], "tp 2", row["stage"]))
        row["vs_one"] = row["tokens_per_s"] / one["tokens_per_s"] if one else None
        row["vs_dp"] = row["tokens_per_s"] / dp["tokens_per_s"] if dp and row["name"] != "dp 2" else None
        row["vs_ds"] = row["tokens_per_s"] / ds["tokens_per_s"] if ds and row["name"] == "tp 2" else None
        row["tp_vs_this"] = tp["tokens_per_s"] / row["tokens_per_s"] if tp and row["name"] == "DeepSpeed tp 2" else None
        if tp and ds and row["name"] in ("tp 2", "DeepSpeed tp 2"):  # the launches of one repeat, side by side
            row["tp_vs_ds_paired"] = [tp["tps_by_repeat"][k] / ds["tps_by_repeat"][k]
                                      for k in sorted(tp["tps_by_repeat"]) if k in ds["tps_by_repeat"]]
        row["state_vs_one"] = row["state_bytes"] / one["state_bytes"] if one else None
        # Δloss: tensor-parallel runs train on the one process's batches; dp 2 on two replicas (vs dp 2 ZeRO 0)
        ref = one if "tp" in row["name"] or row["name"] == "one process" else by.get((row["model"], "dp 2", 0))
        row["max_dloss"] = (max(abs(a - b) for a, b in zip(row["losses"], ref["losses"]))
                            if ref and ref is not row else None)
    return rows


def _f(x, spec, none="—"):
    return none if x is None else format(x, spec)


HEADER = ("| model | system | ZeRO | step s | tokens/s | vs one process | vs dp 2 same ZeRO | zerospeed tp 2 ÷ DeepSpeed tp 2 "
          "(per repeat) | all-reduce s/step (share of the step) | all collectives s/step (in flight) | peak RSS/rank MiB | model states/rank MiB | ÷ one process "
          "| max \\|Δloss\\| |")


def markdown_table(rows: list[dict]) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count(" | ") + 1)]
    for r in rows:
        head = f"| {r['model']} | {r['name']} | {r['stage']} |"
        if r["status"] != "ok":
            msg = (r.get("message") or "").splitlines()[0][:160].replace("|", "/") if r.get("message") else ""
            lines.append(f"{head} {r['status']}: {msg} |" + " — |" * 10)
            continue
        ratio_ds = r["vs_ds"] if r["vs_ds"] is not None else r["tp_vs_this"]
        paired = r.get("tp_vs_ds_paired")
        ratio = _f(ratio_ds, ".3f") + (f" ({', '.join(f'{x:.2f}' for x in paired)})" if paired else "")
        # tensor-parallel all-reduces block inline (their time is the step's); stage 0's bucket all-reduces
        # run during backward, in flight side by side: their summed start-to-finish time exceeds the step
        ar = (f"{r['all_reduce_s']:.2f} ({100 * r['all_reduce_s'] / r['step_s']:.0f}%)" if r.get("tp", 1) > 1
              or r["all_reduce_s"] < 0.05 else f"{r['all_reduce_s']:.1f} in flight (async)")
        lines.append(
            f"{head} {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {_f(r['vs_one'], '.3f')}x | {_f(r['vs_dp'], '.3f')} | "
            f"{ratio} | {ar} | "
            f"{r['comm_s']:.2f} | {r['peak_rss_mib']:,.0f} | {r['state_bytes'] / MiB:,.1f} | "
            f"{_f(r['state_vs_one'], '.3f')} | {_f(r['max_dloss'], '.1e')} |")
    return "\n".join(lines)


def report(saved: dict, base: Path) -> str:
    a = saved["args"]
    seq = SIZES[a["size"]]["seq"]
    rows = aggregate(saved["runs"], a["micro_batch"], seq)
    loads = [r["load_avg_1min"] for r in saved["runs"]]
    params = {r["model"]: r["n_params"] for r in rows if r.get("n_params")}
    header = (f"bench_tp {saved['stamp']}: {a['size']} HF models ({', '.join(f'{m} {p / 1e6:.1f}M' for m, p in params.items())} "
              f"parameters), fp32, micro-batch {a['micro_batch']} x seq {seq} per data-parallel replica, {a['warmup']} "
              f"warm-up + {a['steps']} timed steps, {a['repeats']} interleaved repeat(s) (medians), AdamW lr 3e-4, gloo, "
              f"1 thread per rank; torch {saved['torch']}, deepspeed {saved.get('deepspeed') or 'n/a'}, {saved['cpu']}; "
              f"1-min load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f} during the runs; "
              f"{saved['elapsed_s'] / 60:.1f} min in all. zerospeed: {saved['zerospeed_source']}.")
    md = f"{header}\n\n{markdown_table(rows)}\n"
    base.with_suffix(".md").write_text(md)
    base.with_suffix(".json").write_text(json.dumps({**saved, "rows": rows}, indent=1, default=str))
    print(f"written: {base}.md, {base}.json", file=sys.stderr)
    return md


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print(report(saved, Path(args.report).with_suffix("")))
        return 0
    import importlib.util
    import shutil
    import tempfile

    import torch

    from bench_zero import _cpu_name, write_batches, zerospeed_source

    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = Path(args.out)
    logs = out / f"logs_tp_{stamp}"
    logs.mkdir(parents=True)
    ds_version = None
    if importlib.util.find_spec("deepspeed") is None:
        print("bench_tp: deepspeed is not importable: its rows are left out", file=sys.stderr)
        args.systems = ",".join(s for s in args.systems.split(",") if s.strip() != "deepspeed")
    else:
        from importlib.metadata import version

        ds_version = version("deepspeed")
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="bench_tp_"))
    try:
        data = tmp / "batches.pt"
        write_batches(data, world=2, steps=args.warmup + args.steps, micro=args.micro_batch,
                      seq_len=SIZES[args.size]["seq"], seed=args.seed)
        _, source = zerospeed_source(None, tmp / "unused")
        print(f"bench_tp: zerospeed from {source}; logs in {logs}", file=sys.stderr, flush=True)
        runs = run_all(args, logs, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    saved = {"stamp": stamp, "args": {k: v for k, v in vars(args).items() if k not in ("worker",)},
             "elapsed_s": time.time() - t0, "torch": torch.__version__, "deepspeed": ds_version, "cpu": _cpu_name(),
             "zerospeed_source": source, "runs": runs}
    print(report(saved, out / f"bench_tp_{stamp}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
