"""One AutoEP benchmark run, on every rank (started by `bench_autoep.py` through torchrun; not a user entry point).

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/_autoep_worker.py \
        --system zerospeed --preset tiny --stage 0 --precision fp32 --steps 6 --warmup 2 \
        --data batches.pt --result out.json --launch-time <time.time() before the launch>

`--system deepspeed` runs under the side interpreter of `bench_autoep.py --ds-python` (DeepSpeed 0.19.8's AutoEP
fails with transformers 5.24 before its first step; it runs with 5.18); `zerospeed` under the main one. Both
build the same transformers Mixtral from a `MixtralConfig` after `torch.manual_seed(seed)` (identical initial
weights), `attn_implementation="eager"`, `output_router_logits=True` (loss = cross-entropy + the model's router
auxiliary loss), and hand it unmodified to `<system>.initialize(model=..., config=...)` with the same config:
AdamW lr 1e-4 (torch's, `torch_adam` for DeepSpeed), no clipping, ZeRO `--stage`, `"bf16": {"enabled": true}` for
bf16, and `"expert_parallel": EXPERT_PARALLEL` (ep = `--ep`). Trains `warmup + steps` steps on this rank's
pre-sampled windows (`input_ids = labels = window`), then rank 0 writes one JSON object (`_worker.publish`):
status ("ok" | "not_implemented" | "error"), per-step losses (mean over ranks), per-step wall and CPU times (max
over ranks), peak RSS of every rank, launch-to-first-step seconds, what AutoEP replaced.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

_T_PROCESS = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _systems import _ds_config, all_gather_floats  # noqa: E402
from _worker import peak_rss_bytes, publish  # noqa: E402

SYSTEMS = ("zerospeed", "deepspeed")
LR = 1e-4
# Mixtral shapes. seq is also max_position_embeddings; the data are byte windows (ids < 256 <= vocab).
PRESETS = {
    "tiny": {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2, "experts": 8, "top_k": 2,
             "vocab": 512, "seq": 64, "micro_batch": 4},
    "small": {"hidden": 256, "intermediate": 512, "layers": 4, "heads": 8, "kv_heads": 4, "experts": 8, "top_k": 2,
              "vocab": 1024, "seq": 128, "micro_batch": 4},
}
SHAPE_KEYS = tuple(PRESETS["tiny"])
# The expert_parallel block both systems get (autoep_size from --ep, more keys from --expert-parallel): the
# issue's block, DeepSpeed's defaults. DeepSpeed 0.19.8 needs nothing more on CPU/gloo with transformers 5.18: its
# preset is detected from config.model_type ("mixtral"), and its default use_grouped_mm=true runs
# torch._grouped_mm, which torch 2.13 has on CPU ({"use_grouped_mm": false}: its sequential per-expert loop).
# zerospeed takes the same keys (preset_model checked against the model, use_grouped_mm accepted and ignored).
EXPERT_PARALLEL = {"enabled": True}


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for k in SHAPE_KEYS:  # overrides of the preset
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    p.add_argument("--ep", type=int, default=2, help="expert_parallel.autoep_size")
    p.add_argument("--expert-parallel", type=json.loads, default={},
                   help="JSON object merged over EXPERT_PARALLEL, e.g. '{\"use_grouped_mm\": true}'")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", required=True, help="batches file written by bench_autoep.py (uint8 [world, steps, micro, "
                                                 "seq + 1])")
    p.add_argument("--result", required=True, help="JSON file rank 0 writes")
    p.add_argument("--launch-time", type=float, default=None, help="time.time() when the launcher was started")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a collective gives up")
    return p.parse_args(argv)


def shape(args) -> dict:
    out = dict(PRESETS[args.preset])
    for k in SHAPE_KEYS:
        v = getattr(args, k)
        if v is not None:
            out[k] = v
    return out


def build_model(s: dict, seed: int):
    """The Mixtral every system starts from, identical on every rank and in both interpreters."""
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        num_local_experts=s["experts"], num_experts_per_tok=s["top_k"], max_position_embeddings=s["seq"],
        output_router_logits=True, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(cfg)


def engine_config(args, s: dict, world: int) -> dict:
    cfg = _ds_config(stage=args.stage, precision=args.precision, micro_batch=s["micro_batch"], world_size=world,
                     deepspeed=args.system == "deepspeed")
    cfg["optimizer"]["params"]["lr"] = LR
    cfg["expert_parallel"] = {**EXPERT_PARALLEL, "autoep_size": args.ep, **args.expert_parallel}
    return cfg


def replaced(module) -> dict:
    """What AutoEP put in the model: {class name: count} of the replacement modules, and this rank's expert
    parameter count."""
    names = ("ExpertParallelExperts", "AutoEPMoELayer")
    counts: dict[str, int] = {}
    for m in module.modules():
        n = type(m).__name__
        if n in names:
            counts[n] = counts.get(n, 0) + 1
    return counts


def run(args, rank: int, world: int) -> dict:
    rss_start = peak_rss_bytes()  # torch imported, process group up; no model, no data yet
    s = shape(args)
    batches = torch.load(args.data, weights_only=True)
    total = args.warmup + args.steps
    if batches.shape[0] < world or batches.shape[1] < total or batches.shape[2] < s["micro_batch"] \
            or batches.shape[3] < s["seq"]:
        raise ValueError(f"data file {args.data} holds {tuple(batches.shape)}; need {world} ranks x {total} steps x "
                         f"{s['micro_batch']} x {s['seq']}")
    mine = batches[rank, :total, :s["micro_batch"], :s["seq"]].long().clone()
    del batches
    model = build_model(s, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = engine_config(args, s, world)
    t_setup = time.perf_counter()
    if args.system == "deepspeed":
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
    else:
        import zerospeed

        engine, *_ = zerospeed.initialize(model=model, config=cfg)
    setup_s = time.perf_counter() - t_setup
    module = engine.module
    swapped = replaced(module)
    if not swapped:
        raise RuntimeError(f"{args.system}.initialize replaced no MoE layer: AutoEP did not run")
    local_params = sum(p.numel() for p in module.parameters())

    step_s, cpu_s, losses, first_step_at = [], [], [], None
    for i in range(total):
        ids = mine[i]
        t0, c0 = time.perf_counter(), time.process_time()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        step_s.append(time.perf_counter() - t0)
        cpu_s.append(time.process_time() - c0)
        losses.append(float(loss.detach().float()))
        if i == 0:
            first_step_at = time.time()

    times = all_gather_floats(step_s)
    cpu_times = all_gather_floats(cpu_s)
    loss_ranks = all_gather_floats(losses)
    launch0 = args.launch_time if args.launch_time is not None else _T_PROCESS
    per_rank = all_gather_floats([peak_rss_bytes(), rss_start, first_step_at - launch0, setup_s, local_params])
    return {
        "status": "ok",
        "n_params": n_params,
        "n_params_per_rank": [int(r[4]) for r in per_rank],
        "replaced": swapped,
        "step_s": [max(r[i] for r in times) for i in range(total)],
        "cpu_s": [max(r[i] for r in cpu_times) for i in range(total)],
        "losses": [sum(r[i] for r in loss_ranks) / world for i in range(total)],
        "losses_per_rank": loss_ranks,
        "peak_rss_bytes": [r[0] for r in per_rank],
        "start_rss_bytes": [r[1] for r in per_rank],
        "launch_to_first_step_s": max(r[2] for r in per_rank),
        "setup_s": max(r[3] for r in per_rank),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    s = shape(args)
    meta = {"system": args.system, "preset": args.preset, "shape": s, "stage": args.stage, "precision": args.precision,
            "ep": args.ep, "world_size": world, "steps": args.steps, "warmup": args.warmup,
            "micro_batch": s["micro_batch"], "seq_len": s["seq"], "python": sys.executable, "torch": torch.__version__}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
        if args.system == "zerospeed":
            import zerospeed

            meta["zerospeed_file"] = zerospeed.__file__
        else:
            import deepspeed

            meta["deepspeed"] = deepspeed.__version__
        meta["config"] = engine_config(args, s, world)
        result = run(args, rank, world)
        code = 0
    except NotImplementedError as e:  # a stage / precision this zerospeed does not implement with AutoEP
        result = {"status": "not_implemented", "message": str(e)}
        code = 0
    except Exception as e:  # noqa: BLE001 - reported in the table, the benchmark goes on
        result = {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(result["traceback"], file=sys.stderr, flush=True)
        code = 1
    return publish(args.result, rank, meta, result, code)


if __name__ == "__main__":
    sys.exit(main())
