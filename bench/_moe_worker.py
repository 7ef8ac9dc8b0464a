"""One run of `bench_moe.py`, on every rank (started through torchrun; not a user entry point).

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/_moe_worker.py \
        --system zerospeed --experts 8 --k 2 --drop-tokens 1 --precision fp32 --model small --steps 6 --warmup 2 \
        --data batches.pt --result out.json

The model: the GPT of `zerospeed.testing.models`, every other block (1, 3, 5, ...) with its MLP replaced by
`MoE(d, expert=MLP(d, 4d), num_experts=E, ep_size=world, k=k, capacity_factor=cf, drop_tokens=..., use_rts=False)`
of the system (`zerospeed.moe.layer.MoE` / `deepspeed.moe.layer.MoE`, the same arguments; the other MoE
arguments at their defaults, identical in both); loss = cross-entropy + 0.01 x the sum of the layers' l_aux.
`--system dense`: the same GPT with those blocks' MLPs k x 4d wide (the active compute of top-k routing: a token
runs through k experts of width 4d), trained by zerospeed. Weights: the GPT built after `torch.manual_seed(seed)`,
then each expert re-drawn from a generator seeded by (seed, block, global expert id), the router likewise, so
every system starts from the same global model (rank r holds experts r x E/ep ... of it); the torch RNG is
re-seeded before the first step (top-2's second-expert sampling draws from it).

Rank 0 writes one JSON object: status, per-step losses (mean over ranks), wall and CPU seconds per step (max over
ranks), all-to-all seconds per step (max over ranks; zerospeed: its comms logger, "all_to_all" start to finish;
DeepSpeed: `torch.distributed.all_to_all_single` timed around each call, which DeepSpeed makes blocking), routes
and dropped routes (summed over ranks, MoE layers and steps), peak RSS per rank.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

_T_PROCESS = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _systems import PARAM_GROUPS, _ds_config, _EngineRunner, all_gather_floats, optimizer_groups  # noqa: E402
from _worker import peak_rss_bytes, publish  # noqa: E402

from zerospeed.testing.models import GPT, GPT_SIZES, Block  # noqa: E402

AUX_COEF = 0.01  # weight of the load-balancing loss l_aux
MIN_CAPACITY = 4  # MoE's default (both systems)
SYSTEMS = ("zerospeed", "deepspeed", "dense")


# -- the model ------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """The GPT block's MLP as a module of its own (an expert): Linear(d, hidden), GELU, Linear(hidden, d)."""

    def __init__(self, d: int, hidden: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(d, hidden, bias=bias)
        self.fc_out = nn.Linear(hidden, d, bias=bias)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc(x)))


class MoEBlock(nn.Module):
    """A `testing.models.Block` (its LayerNorms and attention) whose MLP is `mlp`: an MLP, or an MoE layer,
    whose (out, l_aux, exp_counts) it unpacks, keeping l_aux and exp_counts of the last forward."""

    def __init__(self, block: Block, mlp: nn.Module):
        super().__init__()
        self.ln1, self.attn, self.ln2 = block.ln1, block.attn, block.ln2
        self.mlp = mlp
        self.l_aux = self.exp_counts = None

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        out = self.mlp(self.ln2(x))
        if isinstance(out, tuple):
            out, self.l_aux, self.exp_counts = out
        return x + out


class MoEGPT(GPT):
    """`GPT` whose loss adds AUX_COEF x the sum of its MoE blocks' l_aux."""

    def forward(self, idx, targets=None):
        loss = super().forward(idx, targets)
        aux = [b.l_aux for b in self.blocks if getattr(b, "l_aux", None) is not None]
        return loss + AUX_COEF * sum(aux) if aux and targets is not None else loss

    def moe_blocks(self) -> list[MoEBlock]:
        return [b for b in self.blocks if isinstance(b, MoEBlock) and b.exp_counts is not None]


def _draw(module: nn.Module, gen: torch.Generator, out_std: float) -> None:
    """GPT-2's init from `gen`: weights N(0, 0.02) (`fc_out` N(0, out_std)), biases 0."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            else:
                std = out_std if name.endswith("fc_out.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def build_model(model: str, system: str, experts: int, k: int, capacity_factor: float, drop_tokens: bool,
                seed: int, ep_size: int, ep_rank: int) -> MoEGPT:
    cfg = GPT_SIZES[model]
    d, hidden = cfg.d_model, 4 * cfg.d_model
    out_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    torch.manual_seed(seed)
    net = MoEGPT(cfg)
    if system == "deepspeed":
        from deepspeed.moe.layer import MoE
    else:
        from zerospeed.moe.layer import MoE
    for i in range(1, cfg.n_layer, 2):
        if system == "dense":
            mlp = MLP(d, k * hidden, cfg.bias)
            _draw(mlp, torch.Generator().manual_seed(seed * 1000 + i), out_std)
        else:
            mlp = MoE(d, expert=MLP(d, hidden, cfg.bias), num_experts=experts, ep_size=ep_size, k=k,
                      capacity_factor=capacity_factor, drop_tokens=drop_tokens, use_rts=False)
            local = mlp.deepspeed_moe.experts.deepspeed_experts
            for j, expert in enumerate(local):  # global expert id ep_rank x L + j: its own weights
                gid = ep_rank * len(local) + j
                _draw(expert, torch.Generator().manual_seed(seed * 1000 + i * 100 + gid + 1), out_std)
            _draw(mlp.deepspeed_moe.gate, torch.Generator().manual_seed(seed * 1000 + i * 100), out_std)
        net.blocks[i] = MoEBlock(net.blocks[i], mlp)
    return net


# -- all-to-all timing ----------------------------------------------------------------------------------
class A2ATimer:
    """Wraps `torch.distributed.all_to_all_single` (looked up at call time by DeepSpeed's torch backend) and sums
    the seconds of the calls: start to return, which is start to finish for a blocking call (DeepSpeed's)."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        self._orig = dist.all_to_all_single

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return self._orig(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        dist.all_to_all_single = timed

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


class Runner(_EngineRunner):
    """`_systems`' engine runner for the MoE model: DeepSpeed (torch AdamW) or zerospeed (its comms logger on)."""

    def __init__(self, system: str, model: nn.Module, *, stage: int, precision: str, micro_batch: int, world: int,
                 param_groups: int):
        self.system = system
        ds = system == "deepspeed"
        cfg = _ds_config(stage=stage, precision=precision, micro_batch=micro_batch, world_size=world, deepspeed=ds)
        groups = optimizer_groups(model.parameters(), param_groups)
        if param_groups > 1:  # DeepSpeed's MoE group split (configure_moe_param_groups) needs a name per group
            groups = [dict(g, name=name) for g, name in zip(groups, ("decay", "no_decay"))]
        self.a2a = None
        if ds:
            import logging

            import deepspeed

            deepspeed.utils.logger.setLevel(logging.WARNING)
            self.a2a = A2ATimer()
            self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
        else:
            import zerospeed

            cfg["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True}
            self.engine, self.optimizer, _, _ = zerospeed.initialize(model=model, model_parameters=groups, config=cfg)

    def start_step(self):
        if self.a2a is not None:
            self.a2a.take()
        else:
            self.engine.comms_logger.reset()

    def a2a_seconds(self) -> tuple[float, int]:
        """(seconds, calls) in all-to-all since `start_step`."""
        if self.a2a is not None:
            calls, self.a2a.calls = self.a2a.calls, 0
            return self.a2a.take(), calls
        s = self.engine.comms_logger.stats.get("all_to_all")
        return (s.seconds, s.calls) if s is not None else (0.0, 0)


def capacity(tokens: int, experts: int, k: int, capacity_factor: float) -> int:
    """An expert's capacity per rank, as DeepSpeed computes it (float32 product): max(ceil(S / E x k x cf),
    min_capacity)."""
    cap = int(torch.ceil(torch.tensor(tokens / experts) * torch.tensor(capacity_factor * k)))
    return max(cap, MIN_CAPACITY)


def dropped_routes(net: MoEGPT, tokens: int, k: int, capacity_factor: float, drop_tokens: bool) -> tuple[int, int]:
    """(routes, dropped routes) of the last forward on this rank, over its MoE blocks. exp_counts are the routes
    each expert was asked for before the capacity cut (both systems); an expert keeps min(count, C), C =
    `capacity`; dropless: nothing dropped."""
    routes = dropped = 0
    for b in net.moe_blocks():
        counts = b.exp_counts.detach().long().reshape(-1)
        routes += int(counts.sum())
        if drop_tokens:
            dropped += int((counts - capacity(tokens, counts.numel(), k, capacity_factor)).clamp(min=0).sum())
    assert routes in (0, k * tokens * len(net.moe_blocks())), (routes, k, tokens)
    return routes, dropped


def kept_rows(net: MoEGPT, tokens: int, k: int, capacity_factor: float, drop_tokens: bool) -> list[float]:
    """Per MoE block of the last forward, the rows this rank sends each global expert (routes kept after the
    capacity cut, as `dropped_routes` counts them; dropless: every route): blocks x E floats, flattened."""
    out = []
    for b in net.moe_blocks():
        counts = b.exp_counts.detach().long().reshape(-1)
        if drop_tokens:
            counts = counts.clamp(max=capacity(tokens, counts.numel(), k, capacity_factor))
        out.extend(float(c) for c in counts)
    return out


def expert_rows(kept: list[list[list[float]]], experts: int, world: int) -> tuple[list[float], list[float]]:
    """(max over ranks, mean over ranks) of the rows a rank's experts compute per step, summed over the MoE
    blocks: kept[rank][step] = `kept_rows` of that rank and step; expert e lives on rank e // (E / world). The
    max is what an expert-parallel step waits for (the more loaded rank), the mean what it would take balanced."""
    per = experts // world
    most, mean = [], []
    for i in range(len(kept[0])):
        blocks = len(kept[0][i]) // experts
        hi = avg = 0.0
        for b in range(blocks):
            load = [sum(kept[src][i][b * experts + e] for src in range(world) for e in range(r * per, (r + 1) * per))
                    for r in range(world)]
            hi, avg = hi + max(load), avg + sum(load) / world
        most.append(hi)
        mean.append(avg)
    return most, mean


def expert_row_seconds(model: str, precision: str, rows: int = 1024, trials: int = 7) -> float:
    """Seconds per row of one expert alone (`MLP(d, 4d)`, forward + backward of `rows` rows, at the run's
    precision and this rank's threads; median of `trials` after 2 untimed): what every further row a rank's
    experts compute costs at least. Rank 0 runs it while the other ranks wait at a barrier."""
    cfg = GPT_SIZES[model]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    mlp = MLP(cfg.d_model, 4 * cfg.d_model, cfg.bias).to(dtype)
    x = torch.randn(rows, cfg.d_model, dtype=dtype, requires_grad=True)
    times = []
    for i in range(trials + 2):
        t = time.perf_counter()
        mlp(x).float().sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times) / rows


# -- one run --------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--drop-tokens", type=int, choices=(0, 1), default=1)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--model", choices=sorted(GPT_SIZES), default="small")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--param-groups", type=int, choices=PARAM_GROUPS, default=2)
    p.add_argument("--data", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--launch-time", type=float, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a collective gives up")
    return p.parse_args(argv)


def run(args, rank: int, world: int) -> dict:
    rss_start = peak_rss_bytes()
    cfg = GPT_SIZES[args.model]
    total = args.warmup + args.steps
    batches = torch.load(args.data, weights_only=True)  # uint8 [world, steps, micro, seq + 1]
    if batches.shape[0] < world or batches.shape[1] < total:
        raise ValueError(f"data file {args.data} holds {tuple(batches.shape)}; need {world} ranks x {total} steps")
    mine = batches[rank, :total, :args.micro_batch, :cfg.seq_len + 1].long().clone()
    del batches
    drop = bool(args.drop_tokens)
    net = build_model(args.model, args.system, args.experts, args.k, args.capacity_factor, drop, args.seed,
                      ep_size=world, ep_rank=rank)
    n_params = sum(p.numel() for p in net.parameters())
    runner = Runner(args.system, net, stage=args.stage, precision=args.precision, micro_batch=args.micro_batch,
                    world=world, param_groups=args.param_groups)
    torch.manual_seed(args.seed + 1)  # the routing noise starts from the same state in every system
    tokens = args.micro_batch * cfg.seq_len
    step_s, cpu_s, losses, a2a_s, a2a_calls, routes, dropped = [], [], [], [], [], 0, 0
    kept: list[list[float]] = []  # per step: rows this rank sends each expert (`kept_rows`)
    first_step_at = None
    for i in range(total):
        x, y = mine[i, :, :-1], mine[i, :, 1:]
        runner.start_step()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = runner.forward_backward(x, y)
        runner.step()
        step_s.append(time.perf_counter() - t0)
        cpu_s.append(time.process_time() - c0)
        secs, calls = runner.a2a_seconds()
        a2a_s.append(secs)
        a2a_calls.append(calls)
        losses.append(float(loss.detach().float()))
        if args.system != "dense":
            r, d = dropped_routes(net, tokens, args.k, args.capacity_factor, drop)
            routes, dropped = routes + r, dropped + d
            kept.append(kept_rows(net, tokens, args.k, args.capacity_factor, drop))
        if i == 0:
            first_step_at = time.time()
    times, cpus, a2as, loss_ranks = (all_gather_floats(v) for v in (step_s, cpu_s, a2a_s, losses))
    launch0 = args.launch_time if args.launch_time is not None else _T_PROCESS
    per_rank = all_gather_floats([peak_rss_bytes(), rss_start, routes, dropped, n_params, first_step_at - launch0])
    rows_max = rows_mean = None
    if kept:  # the experts' rows per step on the more loaded rank, and balanced (since session 35)
        width = len(kept[0])
        flat = all_gather_floats([v for step in kept for v in step])
        rows_max, rows_mean = expert_rows([[r[i * width:(i + 1) * width] for i in range(total)] for r in flat],
                                          args.experts, world)
    row_s = expert_row_seconds(args.model, args.precision) if kept and rank == 0 else None
    dist.barrier()
    return {
        "status": "ok",
        "n_params_per_rank": [r[4] for r in per_rank],
        "step_s": [max(r[i] for r in times) for i in range(total)],
        "cpu_s": [max(r[i] for r in cpus) for i in range(total)],
        "a2a_s": [max(r[i] for r in a2as) for i in range(total)],
        "a2a_calls_per_step": a2a_calls[-1],
        "losses": [sum(r[i] for r in loss_ranks) / world for i in range(total)],
        "peak_rss_bytes": [r[0] for r in per_rank],
        "start_rss_bytes": [r[1] for r in per_rank],
        "routes": sum(r[2] for r in per_rank),
        "dropped_routes": sum(r[3] for r in per_rank),
        "launch_to_first_step_s": max(r[5] for r in per_rank),
        "expert_rows_max": rows_max, "expert_rows_mean": rows_mean, "expert_row_s": row_s,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    meta = {k: getattr(args, k) for k in ("system", "experts", "k", "capacity_factor", "stage", "precision", "model",
                                          "steps", "warmup", "micro_batch", "param_groups")}
    meta.update(drop_tokens=bool(args.drop_tokens), world_size=world, seq_len=GPT_SIZES[args.model].seq_len,
                torch=torch.__version__)
    if args.system == "deepspeed":
        import deepspeed

        meta["deepspeed"] = deepspeed.__version__
    else:
        import zerospeed

        meta["zerospeed_file"] = zerospeed.__file__
    try:
        result = run(args, rank, world)
        code = 0
    except Exception as e:  # noqa: BLE001 - reported in the table, the benchmark goes on
        result = {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(result["traceback"], file=sys.stderr, flush=True)
        code = 1
    return publish(args.result, rank, meta, result, code)


if __name__ == "__main__":
    sys.exit(main())
