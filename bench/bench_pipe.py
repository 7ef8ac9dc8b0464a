"""Pipeline parallelism (issue 24): zerospeed's schedules against DeepSpeed's and torch's, in one run.

    python bench/bench_pipe.py                   # the full table: 13 configurations x 2 models x 2 precisions x m 4, 8
                                                 # x 3 repeats = 312 launches, about 1 h per repeat here (estimated:
                                                 # an MLP launch ~10 s, a GPT one ~1 min)
    python bench/bench_pipe.py --models mlp --precisions fp32 --microbatches 8 --repeats 3     # ~6 min
    python bench/bench_pipe.py --quick                           # a smoke run: tiny shapes, 1 repeat (~4 min)
    python bench/bench_pipe.py --quick --models mlp --systems reference,zerospeed --schedules 1f1b,zb_v
    python bench/bench_pipe.py --report bench/results/bench_pipe_<stamp>.json            # re-render

Models (each a list of LayerSpecs, built with `seed_layers=True` and base seed `--seed`, layer i after
seeding base + i, so every system and partition starts from the same weights; the re-seeding before every
layer of every forward that seed_layers also does, in zerospeed and DeepSpeed alike, is switched off after
building (`module.seed_layers = False`; ~0.1 ms a layer here, for dropout only; `--forward-reseed 1` keeps it)):

    mlp  8 MLP layers at hidden 1024, each Linear(1024, 1536) / ReLU / Linear(1536, 1024) as 3 LayerSpecs
         (24 specs, 25.2M parameters), partition "uniform"; MSE against tanh(roll(x)); `--micro-batch` samples
         of [1024] per micro-batch. (Read as "8 layers, 25M": single 1024 x 1024 Linears are 8.4M at 8 layers.)
    gpt  zerospeed.testing.models' GPT blocks (`--gpt-size` small: d 384, 6 heads, seq 256, byte vocabulary,
         with `--gpt-layers` 8 blocks instead of 6 so 2 and 4 model stages get equal blocks; 14.5M parameters)
         as LayerSpecs: an embedding layer (token + position), the blocks, a head (final LayerNorm + lm_head,
         untied: a tie needs TiedLayerSpec, which torch.distributed.pipelining has no counterpart of); GPT-2
         init; partition "type:GPTBlock" (the blocks balanced, the embedding with the first model stage, the
         head with the last); cross-entropy; `--gpt-micro-batch` windows of the demo text per micro-batch.

Configurations, each its own torchrun launch (2 ranks = 2 pipeline stages, gloo, OMP_NUM_THREADS=1 and
torch.set_num_threads(1) per rank), per model x precision x micro-batch count m (`--microbatches`):

    one process            world 1: zerospeed's ordinary engine (ZeRO 0) on the whole stack as one module,
                           gradient_accumulation_steps m (the reference: loss, speed-up; stage times, below)
    zerospeed <schedule>   zerospeed.pipe.PipelineModule + "pipeline": {"schedule": 1f1b | gpipe | zb_h1 |
                           interleaved_1f1b (chunks=2) | zb_v (chunks=2, chunk_layout="v")}, and
                           zerospeed.pipe.DualPipeVModule + "dualpipev" (DeepSpeed's API; built in 337043e,
                           during this benchmark's writing). A zerospeed without DualPipeVModule (an older
                           --zerospeed-ref) makes that row "error: ... not built yet"; its target row then shows
                           zb_v ÷ DeepSpeed DualPipeV (the closest: the same V of 2 chunks per rank)
    zerospeed 1f1b, fused  "zerospeed 1f1b" with "split_backward": false: autograd's fused backward (schedule
    backward               name "1f1b_fused"; every other zerospeed row runs each backward as its input- and
                           weight-gradient passes in fp32, zerospeed's default since this row was added;
                           in bf16 a schedule's fused backwards, and each B followed at once by its W, run
                           as autograd's fused backward, since session 39)
    DeepSpeed 1F1B         deepspeed.pipe.PipelineModule -> PipelineEngine (TrainSchedule); seed_fn=
                           set_random_seed(int(seed)): with a "type:" partition DeepSpeed 0.19.8's stage bounds
                           are numpy integers, which random.seed refuses under seed_layers=True
    DeepSpeed DualPipeV    deepspeed.pipe.DualPipeVModule -> DualPipeVEngine (needs m >= 4)
    torch <schedule>       torch.distributed.pipelining PipelineStage(s) over the same layers (nn.Sequential
                           per model stage) with Schedule1F1B, ScheduleInterleaved1F1B (loop placement),
                           ScheduleZBVZeroBubble, ScheduleDualPipeV (V placement); torch.optim.AdamW

All: AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0, no clipping, ZeRO 0 (DeepSpeed:
`torch_adam: true`, `gradient_clipping: 0.0`). bf16: zerospeed and DeepSpeed `"bf16": {"enabled": true}`
(bf16 weights, fp32 master weights in the optimizer); torch: each stage's forward under
`torch.autocast("cpu", torch.bfloat16)` with fp32 weights (torch's own mixed-precision recipe, as DDP's row
in bench_zero.py); every system gets the same bf16-rounded inputs and targets (MLP). Losses are computed in
fp32 (`out.float()`).

Every rank trains `--warmup` + `--steps` steps on the same data (the parent writes it once, fixed seed);
each step starts after a barrier (not timed) and its time is the slowest rank's `train_batch` (torch:
`schedule.step` + optimizer step). samples/s = micro-batch x m / median timed step (the medians over
repeats; repeats interleaved, each repeat starting one configuration later). Peak RSS per rank: ru_maxrss
at the end of training. Final loss: the mean loss of the last step (its batch's micro-batches).

Pipeline time and bubble. Compute = wall time inside the forward / backward / loss calls of a step, timed by
wrapping them in the worker (no change to any engine): zerospeed `PipelineModule.forward_segments/
forward_chunk` and `runtime.pipe_engine.backward_fused/backward_input/backward_weight`; DeepSpeed its
ForwardPass / BackwardPass instructions (a per-instance copy of `_INSTRUCTION_MAP`); torch
`PipelineStage.forward_one_chunk/backward_one_chunk/backward_weight_one_chunk`; plus the loss function.
Optimizer = the engine's optimizer step (zerospeed `_optimizer_step`, DeepSpeed's OptimizerStep, torch's
`optimizer.step`; the table shows the fastest rank's: the other's can include waiting for it in the gradient
norm's all-reduce over the pipe group, which zerospeed runs even with clipping off). Pipeline time = from the
step's start to the last rank's optimizer step (the step without the optimizer and the loss's reduction: the
makespan the simulator predicts). Measured bubble = 1 - (sum over ranks of compute) / (p x pipeline time),
against the ideal (p - 1)/(m + p - 1) of 1F1B/GPipe and the simulator's bubble fraction.

Simulator. Stage times per model stage for one micro-batch, each stage built alone (zerospeed
PipelineModule(stage_id=s), cast to bf16 under bf16; stage 0 reads a real micro-batch, later stages a random
activation of the right shape), median of `--profile-reps` after a warm-up: forward (forward_segments + the
loss on the last stage), input-gradient pass (`backward_split.backward_input`), weight-gradient pass
(`backward_weight`), and the fused forward/backward (`forward_chunk` + `backward_fused`); gradients accumulate
from the warm-up on, as over a batch's micro-batches. Measured twice: (a) in every pipeline launch after
training (and after its peak RSS is read), each rank timing the model stages it holds, both ranks at once, so
under the contention of the pipeline's own two processes (the prediction the target is judged on), and (b) in
the one-process launch, every stage of 2 and of 4 one after another (one core busy; a second column). A
schedule's per-rank StageTimes sum its rank's model stages (2 stages: stage r; interleaved: r and r + 2; V: r
and 3 - r); zerospeed's fp32 rows get the split times (every backward is split, `"split_backward"`), the
other rows of a schedule without a split (DeepSpeed's, "1f1b_fused", bf16, torch's) the fused ones
(backward_input = the fused backward, backward_weight = 0);
send latency: one activation message between the ranks, measured in each pipeline launch after training
(half the median round trip of the activation tensor; `message_latency`). (c) A third column feeds the
simulator the forward / backward / weight seconds per micro-batch timed inside the run itself (the compute
timers above, per rank / m), with the same measured send latency: it tests the schedule model alone
(dependencies and messages, no engine overhead), apart from how well a stage timed alone predicts the stage
inside the pipeline.
`simulate(build_schedule(...), times).step_time` is the predicted pipeline time, compared with the measured
one (the optimizer is not simulated). DeepSpeed and torch rows are predicted with the zerospeed schedule of
the same order (DeepSpeed 1F1B, torch 1F1B -> 1f1b; torch Interleaved1F1B -> interleaved_1f1b; torch
ZBVZeroBubble -> zb_v; DeepSpeed and torch DualPipeV -> dualpipev, which with DeepSpeed's fused backward
(weight-gradient passes costing 0, its stage times fused) is DeepSpeed's DualPipeVSchedule order) and, for
the stage-time columns, with zerospeed's stage costs: approximate.

Targets (issue 24), per model x precision x m: zerospeed 1F1B >= 1.10x DeepSpeed 1F1B samples/s; zerospeed
DualPipeV >= 1.10x DeepSpeed DualPipeV; the best zerospeed schedule >= 1.20x the
best DeepSpeed one and >= 1.05x the best torch one; the simulator within 10% of every zerospeed schedule's
measured pipeline time. Each ratio target's "limit" column: the ratio with the zerospeed side at its schedule's
floor (`floor_samples_per_s`: its own measured compute, the idle time only its schedule cannot avoid - 1F1B's
ideal bubble, or for the zero-bubble schedules one chunk forward at the start - and its optimizer time), the
other side as measured: what no schedule change at this compute per micro-batch can beat.

A configuration that fails (a refusal, an exception, a timeout) is an "error: ..." row with its first error
line and is not relaunched in later repeats; the run goes on. Without deepspeed importable its rows are
left out. Writes bench/results/bench_pipe_<stamp>.{md,json} and logs_pipe_<stamp>/. `--zerospeed-ref REF`
benchmarks zerospeed as committed at a git ref (a stable snapshot while src/ is being edited).

The worker is this file too (`--worker`, started by torchrun); not collected by pytest.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MiB = 2**20
P = 2  # pipeline ranks (stages): the machine has 2 cores
ADAM = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
ZS_SCHEDULES = ("1f1b", "gpipe", "zb_h1", "interleaved_1f1b", "zb_v", "dualpipev")
# (label, system, schedule, world)
# "1f1b_fused": zerospeed 1F1B with autograd's fused backward ("split_backward": false; the other rows split
# every backward into its input- and weight-gradient passes, the default)
CONFIGS = ([("one process", "reference", "-", 1)]
           + [(f"zerospeed {s}", "zerospeed", s, P) for s in ZS_SCHEDULES]
           + [("zerospeed 1f1b, fused backward", "zerospeed", "1f1b_fused", P)]
           + [("DeepSpeed 1F1B", "deepspeed", "1f1b", P), ("DeepSpeed DualPipeV", "deepspeed", "dualpipev", P)]
           + [("torch 1F1B", "torch", "1f1b", P), ("torch Interleaved1F1B", "torch", "interleaved_1f1b", P),
              ("torch ZBVZeroBubble", "torch", "zb_v", P), ("torch DualPipeV", "torch", "dualpipev", P)])
SYSTEMS = ("reference", "zerospeed", "deepspeed", "torch")
ALL_SCHEDULES = ("-",) + ZS_SCHEDULES + ("1f1b_fused",)
# the zerospeed schedule whose order a row runs (for the simulator); None: no zerospeed counterpart
SIM_SCHEDULE = {("zerospeed", s): s for s in ZS_SCHEDULES} | {("zerospeed", "1f1b_fused"): "1f1b",
    ("deepspeed", "1f1b"): "1f1b", ("deepspeed", "dualpipev"): "dualpipev", ("torch", "1f1b"): "1f1b",
    ("torch", "interleaved_1f1b"): "interleaved_1f1b", ("torch", "zb_v"): "zb_v", ("torch", "dualpipev"): "dualpipev"}
# (chunks per rank, chunk layout) of each schedule (zerospeed.pipe.schedule.SCHEDULE_LAYOUTS' layouts)
LAYOUT = {"1f1b": (1, "interleaved"), "gpipe": (1, "interleaved"), "zb_h1": (1, "interleaved"),
          "interleaved_1f1b": (2, "interleaved"), "zb_v": (2, "v"), "dualpipev": (2, "v"),
          "1f1b_fused": (1, "interleaved")}
QUICK = {"mlp_layers": 8, "mlp_hidden": 256, "mlp_ffn": 384, "micro_batch": 8, "gpt_size": "tiny", "gpt_layers": 4,
         "gpt_micro_batch": 2, "steps": 2, "warmup": 1, "repeats": 1, "microbatches": "4", "profile_reps": 2,
         "timeout": 300.0}


# -- models -------------------------------------------------------------------------------------------------
class GPTEmbed(nn.Module):
    """Token + learned position embeddings (GPT's first layer as a LayerSpec); GPT-2 init."""

    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        for e in (self.wte, self.wpe):
            nn.init.normal_(e.weight, 0.0, 0.02)

    def forward(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class GPTBlock(nn.Module):
    """zerospeed.testing.models.Block with GPT's init (normal 0.02, residual projections scaled)."""

    def __init__(self, cfg):
        from zerospeed.testing.models import GPT, Block

        super().__init__()
        self.block = Block(cfg)
        self.block.apply(GPT._init_weights)
        for name, p in self.block.named_parameters():
            if name.endswith(("fc_out.weight", "proj.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x):
        return self.block(x)


class GPTHead(nn.Module):
    """Final LayerNorm + lm_head (untied), GPT's last layer as a LayerSpec."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, 0.0, 0.02)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def gpt_config(args):
    """GPT_SIZES[--gpt-size] with --gpt-layers blocks (0: the size's own), untied head."""
    import dataclasses

    from zerospeed.testing.models import GPT_SIZES

    cfg = GPT_SIZES[args.gpt_size]
    return dataclasses.replace(cfg, n_layer=args.gpt_layers or cfg.n_layer, tie_weights=False)


def partition_of(kind: str) -> str:
    """mlp: uniform (24 identical-cost specs); gpt: balance the blocks (type:GPTBlock), the embedding riding with
    the first stage and the head with the last, so 8 blocks split 4 + 4 and 2 + 2 + 2 + 2."""
    return "uniform" if kind == "mlp" else "type:GPTBlock"


def layer_specs(kind: str, spec_cls, args) -> list:
    """The model as a list of `spec_cls` (zerospeed's or DeepSpeed's LayerSpec)."""
    if kind == "mlp":
        h, f = args.mlp_hidden, args.mlp_ffn
        specs = []
        for _ in range(args.mlp_layers):
            specs += [spec_cls(nn.Linear, h, f), spec_cls(nn.ReLU), spec_cls(nn.Linear, f, h)]
        return specs
    cfg = gpt_config(args)
    return [spec_cls(GPTEmbed, cfg)] + [spec_cls(GPTBlock, cfg) for _ in range(cfg.n_layer)] + \
        [spec_cls(GPTHead, cfg)]


def mse_loss(out, y):
    return F.mse_loss(out.float(), y.float())


def lm_loss(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


LOSSES = {"mlp": mse_loss, "gpt": lm_loss}


def micro_batch_of(args, kind: str) -> int:
    return args.micro_batch if kind == "mlp" else args.gpt_micro_batch


def write_data(path: Path, kind: str, args, steps: int, m: int) -> None:
    """x, y: [steps, m, micro, ...] (mlp: fp32 [1024]-vectors; gpt: byte windows of the demo text)."""
    gen = torch.Generator().manual_seed(args.seed)
    mb = micro_batch_of(args, kind)
    if kind == "mlp":
        x = torch.randn(steps, m, mb, args.mlp_hidden, generator=gen)
        y = torch.tanh(torch.roll(x, 1, dims=-1))
    else:
        from zerospeed.demo.data import load_corpus, sample_batch, split_corpus

        corpus = load_corpus()
        train = split_corpus(corpus, min(1 << 20, corpus.numel() // 10)).train
        seq = gpt_config(args).seq_len
        xs, ys = zip(*(sample_batch(train, mb, seq, gen) for _ in range(steps * m)))
        x = torch.stack(xs).view(steps, m, mb, seq).to(torch.uint8)
        y = torch.stack(ys).view(steps, m, mb, seq).to(torch.uint8)
    torch.save({"x": x, "y": y}, path)


def load_data(path: str, kind: str, precision: str, steps: int, m: int) -> list[list[tuple]]:
    d = torch.load(path, weights_only=True)
    x, y = d["x"][:steps, :m], d["y"][:steps, :m]
    if kind == "gpt":
        x, y = x.long(), y.long()
    elif precision == "bf16":
        x, y = x.bfloat16(), y.bfloat16()
    return [[(x[i, j].clone(), y[i, j].clone()) for j in range(m)] for i in range(steps)]


# -- worker: timing --------------------------------------------------------------------------------------
KINDS = ("forward", "backward", "weight")  # compute; "backward" is fused or input-gradient, "weight" deferred W


class Timer:
    """Seconds inside wrapped calls this step, by kind: "forward" (forward passes and the loss), "backward" (fused
    backward, or the input-gradient pass), "weight" (deferred weight-gradient pass), "opt" (optimizer step),
    "send" (zerospeed's activation and gradient send calls; `calls` counts them), "recv" (zerospeed's receive
    calls and its wait for the sends: mostly waiting for a message, i.e. idle);
    and `opt_start` (perf_counter when the step's first optimizer call began: the end of this rank's pipeline).
    Nested wrapped calls count once (the outermost)."""

    def __init__(self):
        self._depth = 0
        self.reset()

    def reset(self):
        self.seconds = dict.fromkeys(KINDS + ("opt", "send", "recv"), 0.0)
        self.calls = dict.fromkeys(self.seconds, 0)
        self.opt_start = None

    @property
    def compute(self) -> float:
        return sum(self.seconds[k] for k in KINDS)

    def wrap(self, fn, kind: str):
        assert kind in self.seconds, kind

        def timed(*a, **k):
            if self._depth:
                return fn(*a, **k)
            self._depth += 1
            self.calls[kind] += 1
            t0 = time.perf_counter()
            if kind == "opt" and self.opt_start is None:
                self.opt_start = t0
            try:
                return fn(*a, **k)
            finally:
                self._depth -= 1
                self.seconds[kind] += time.perf_counter() - t0
        return timed


def _adam(torch_adam: bool) -> dict:
    return dict(ADAM, torch_adam=True) if torch_adam else dict(ADAM)


def _ds_config(args, mb: int, m: int, deepspeed: bool, extra: dict | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": m,
           "optimizer": {"type": "AdamW", "params": _adam(deepspeed)}, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 0}, "bf16": {"enabled": args.precision == "bf16"},
           "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if deepspeed:
        cfg["train_batch_size"] = mb * m
    cfg.update(extra or {})
    return cfg


class _Autocast(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x)


def _zs_stage_module(args, kind: str, num_stages: int, stage_id: int):
    """One model stage of the stack, alone (zerospeed's PipelineModule: the same seeds as every system)."""
    from zerospeed.pipe import LayerSpec, PipelineModule

    module = PipelineModule(layer_specs(kind, LayerSpec, args), num_stages=num_stages, stage_id=stage_id,
                            loss_fn=LOSSES[kind], partition_method=partition_of(kind), seed_layers=True,
                            base_seed=args.seed)
    return _reseed(module, args)


def _reseed(module, args):
    """seed_layers=True seeds each layer's build (same weights everywhere) and, in zerospeed and DeepSpeed alike,
    re-seeds Python/numpy/torch before every layer of every forward (~0.1 ms a layer here, for dropout only):
    off unless --forward-reseed (the attribute is read at forward time in both)."""
    module.seed_layers = bool(args.forward_reseed)
    return module


class ReferenceRunner:
    """zerospeed's ordinary engine on the whole stack in one process, gradient accumulation m."""

    def __init__(self, args, kind, m, timer):
        import zerospeed

        whole = _zs_stage_module(args, kind, 1, 0)
        self.net = _Whole(nn.Sequential(*whole.forward_funcs), LOSSES[kind])
        self.n_params = sum(p.numel() for p in self.net.parameters())
        self.engine, *_ = zerospeed.initialize(model=self.net, config=_ds_config(args, micro_batch_of(args, kind), m,
                                                                                 False))
        self.timer = timer
        self.fwd = timer.wrap(self.engine.__call__, "forward")
        self.bwd = timer.wrap(self.engine.backward, "backward")
        self.opt = timer.wrap(self.engine.step, "opt")

    def train_step(self, mbs) -> float:
        losses = []
        for j, (x, y) in enumerate(mbs):
            loss = self.fwd(x, y)
            self.bwd(loss)
            (self.opt if j == len(mbs) - 1 else self.engine.step)()  # a no-op before the boundary
            losses.append(float(loss.detach().float()))
        return sum(losses) / len(losses)


class _Whole(nn.Module):
    def __init__(self, seq, loss_fn):
        super().__init__()
        self.seq, self.loss_fn = seq, loss_fn

    def forward(self, x, y):
        return self.loss_fn(self.seq(x), y)


class ZeroSpeedRunner:
    def __init__(self, args, kind, m, timer):
        import zerospeed
        import zerospeed.runtime.pipe_engine as pe
        from zerospeed import pipe as zpipe

        common = {"num_stages": P, "loss_fn": timer.wrap(LOSSES[kind], "forward"),
                  "partition_method": partition_of(kind), "seed_layers": True, "base_seed": args.seed}
        if args.schedule == "dualpipev":  # DeepSpeed's API: a DualPipeVModule (PipelineModule, chunks=2 in a V)
            if not hasattr(zpipe, "DualPipeVModule"):
                raise NotImplementedError("this zerospeed has no DualPipeVModule (DualPipeV not built yet)")
            module = zpipe.DualPipeVModule(layer_specs(kind, zpipe.LayerSpec, args), **common)
        else:
            chunks, layout = LAYOUT[args.schedule]
            module = zpipe.PipelineModule(layer_specs(kind, zpipe.LayerSpec, args), chunks=chunks,
                                          chunk_layout=layout, **common)
        _reseed(module, args)
        self.n_params = sum(p.numel() for p in module.parameters())
        pipeline = {"schedule": args.schedule.removesuffix("_fused")}
        if args.schedule.endswith("_fused"):
            pipeline["split_backward"] = False
        cfg = _ds_config(args, micro_batch_of(args, kind), m, False, {"pipeline": pipeline})
        self.engine, *_ = zerospeed.initialize(model=module, config=cfg)
        # timing wrappers (the engine looks these up at call time): no change to the engine's code
        for name, what in (("backward_fused", "backward"), ("backward_input", "backward"),
                           ("backward_weight", "weight")):
            setattr(pe, name, timer.wrap(getattr(pe, name), what))
        mod = self.engine.module
        mod.forward_segments = timer.wrap(mod.forward_segments, "forward")
        mod.forward_chunk = timer.wrap(mod.forward_chunk, "forward")
        self.engine._optimizer_step = timer.wrap(self.engine._optimizer_step, "opt")
        link = self.engine._link  # the seconds a rank spends in its send calls: the simulator's send_overhead
        link.send_activation = timer.wrap(link.send_activation, "send")
        link.send_grads = timer.wrap(link.send_grads, "send")
        for name in ("recv_activation", "recv_grads", "wait_sends"):  # waiting: the rest is the executor's work
            setattr(link, name, timer.wrap(getattr(link, name), "recv"))
        self.has_first, self.has_last = self.engine.is_first_stage(), self.engine.is_last_stage()

    def train_step(self, mbs) -> float:
        return float(self.engine.train_batch(iter(mbs)).float())


class DeepSpeedRunner:
    def __init__(self, args, kind, m, timer):
        import logging

        import deepspeed
        from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule
        from deepspeed.runtime.pipe import schedule as S

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
        from deepspeed.runtime.utils import set_random_seed

        cls = DualPipeVModule if args.schedule == "dualpipev" else PipelineModule
        # seed_fn: its own set_random_seed, given an int: with a "type:" partition DeepSpeed 0.19.8's stage bounds
        # are numpy integers, which random.seed refuses (TypeError) under seed_layers=True
        module = cls(layers=layer_specs(kind, LayerSpec, args), num_stages=P,
                     loss_fn=timer.wrap(LOSSES[kind], "forward"), partition_method=partition_of(kind),
                     seed_layers=True, base_seed=args.seed,
                     seed_fn=lambda seed: set_random_seed(int(seed)))
        _reseed(module, args)
        params = [p for p in module.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in params)
        self.engine, *_ = deepspeed.initialize(model=module, model_parameters=params,
                                               config=_ds_config(args, micro_batch_of(args, kind), m, True))
        table = dict(type(self.engine)._INSTRUCTION_MAP)  # the instance's copy, with timed compute and step
        table[S.ForwardPass] = timer.wrap(table[S.ForwardPass], "forward")
        table[S.BackwardPass] = timer.wrap(table[S.BackwardPass], "backward")
        table[S.OptimizerStep] = timer.wrap(table[S.OptimizerStep], "opt")
        self.engine._INSTRUCTION_MAP = table

    def train_step(self, mbs) -> float:
        return float(self.engine.train_batch(iter(mbs)).float())


class TorchRunner:
    def __init__(self, args, kind, m, timer):
        import torch.distributed as dist
        from torch.distributed import pipelining as tp

        rank = dist.get_rank()
        chunks = 1 if args.schedule == "1f1b" else 2
        n = P * chunks
        mine = {"1f1b": [rank], "interleaved_1f1b": [rank, rank + P]}.get(args.schedule, [rank, 2 * P - 1 - rank])
        self.stages, params = [], []
        for s in mine:
            seq = nn.Sequential(*_zs_stage_module(args, kind, n, s).forward_funcs)
            params += list(seq.parameters())
            stage = tp.PipelineStage(_Autocast(seq) if args.precision == "bf16" else seq, s, n, torch.device("cpu"))
            for name, what in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                               ("backward_weight_one_chunk", "weight")):
                setattr(stage, name, timer.wrap(getattr(stage, name), what))
            self.stages.append(stage)
        self.n_params = sum(p.numel() for p in params)
        cls = {"1f1b": tp.Schedule1F1B, "interleaved_1f1b": tp.ScheduleInterleaved1F1B,
               "zb_v": tp.ScheduleZBVZeroBubble, "dualpipev": tp.ScheduleDualPipeV}[args.schedule]
        self.schedule = cls(self.stages[0] if chunks == 1 else self.stages, n_microbatches=m,
                            loss_fn=timer.wrap(LOSSES[kind], "forward"))
        self.optimizer = torch.optim.AdamW(params, lr=ADAM["lr"], betas=tuple(ADAM["betas"]), eps=ADAM["eps"],
                                           weight_decay=ADAM["weight_decay"])
        self.opt_step = timer.wrap(self.optimizer.step, "opt")
        self.has_first, self.has_last = 0 in mine, n - 1 in mine

    def train_step(self, mbs) -> float:
        import torch.distributed as dist

        x = torch.cat([a for a, _ in mbs])
        y = torch.cat([b for _, b in mbs])
        losses: list = []
        args = (x,) if self.has_first else ()
        kwargs = {"target": y, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        self.opt_step()
        self.optimizer.zero_grad(set_to_none=True)
        t = torch.tensor(float(torch.stack([v.detach().float() for v in losses]).mean()) if losses else 0.0,
                         dtype=torch.float64)
        dist.all_reduce(t)  # only the rank holding the last stage contributes
        return float(t)


RUNNERS = {"reference": ReferenceRunner, "zerospeed": ZeroSpeedRunner, "deepspeed": DeepSpeedRunner,
           "torch": TorchRunner}


# -- worker: per-stage times for the simulator -----------------------------------------------------------
def _stage_input(args, kind: str, mb: int):
    """A stand-in for the activation a later model stage receives (mlp [mb, hidden]; gpt [mb, seq, d_model])."""
    if kind == "mlp":
        shape = (mb, args.mlp_hidden)
    else:
        cfg = gpt_config(args)
        shape = (mb, cfg.seq_len, cfg.d_model)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(args.seed))
    return x.bfloat16() if args.precision == "bf16" else x


def time_stage(args, kind: str, m: int, n: int, s: int, x, y) -> dict:
    """Model stage s of n, built alone (zerospeed's PipelineModule, cast to bf16 under bf16), one micro-batch:
    median of args.profile_reps (after a warm-up) seconds of forward (+ the loss / m on the last stage),
    input-gradient pass, weight-gradient pass (zerospeed's backward split, as its engine runs them), and the
    fused forward and backward. Stage 0 reads the micro-batch x; later stages a random activation."""
    from zerospeed.pipe.backward_split import (
        backward_fused,
        backward_input,
        backward_weight,
        detach_input,
    )

    loss_fn = LOSSES[kind]
    mod = _zs_stage_module(args, kind, n, s)
    if args.precision == "bf16":
        mod.to(torch.bfloat16)
    last = s == n - 1
    inp = x if s == 0 else _stage_input(args, kind, x.shape[0])
    samples = {k: [] for k in ("forward", "backward_input", "backward_weight", "forward_fused", "backward_fused")}
    for rep in range(args.profile_reps + 1):  # gradients accumulate from the warm-up on (as over micro-batches)
        xin = inp if s == 0 else detach_input(inp)
        t0 = time.perf_counter()
        o, segs = mod.forward_segments(xin)
        if last:
            segs[-1].output = loss_fn(o, y) / m
        t1 = time.perf_counter()
        g = None if last else torch.ones_like(o)  # the output gradient the next stage would send
        t2 = time.perf_counter()
        pending, _ = backward_input(segs, g)
        t3 = time.perf_counter()
        backward_weight(pending)
        t4 = time.perf_counter()
        del segs, pending, o
        xin = inp if s == 0 else detach_input(inp)
        t5 = time.perf_counter()
        o = mod.forward_chunk(None, xin)
        target = loss_fn(o, y) / m if last else o
        t6 = time.perf_counter()
        backward_fused(target, g)
        t7 = time.perf_counter()
        if rep:
            for k, v in zip(samples, (t1 - t0, t3 - t2, t4 - t3, t6 - t5, t7 - t6)):
                samples[k].append(v)
    return {k: statistics.median(v) for k, v in samples.items()}


def held_stages(schedule: str, rank: int) -> tuple[int, list[int]]:
    """(model stages in all, those on pipeline rank `rank`) for a zerospeed schedule name's layout."""
    chunks, layout = LAYOUT[schedule]
    if chunks == 1:
        return P, [rank]
    return 2 * P, [rank, rank + P] if layout == "interleaved" else [rank, 2 * P - 1 - rank]


def profile_stages(args, kind: str, m: int, mbs: list) -> dict:
    """The one-process launch: every model stage of 2 and of 4, one after another. {"2": [per stage], "4": ...}."""
    x, y = mbs[0]
    return {str(n): [time_stage(args, kind, m, n, s, x, y) for s in range(n)] for n in (P, 2 * P)}


def message_latency(args, kind: str, mb: int, reps: int = 20) -> float:
    """Seconds for one activation message between the two ranks over gloo (the stage-to-stage send the
    simulator's `send_latency` stands for): half the median round trip of `_stage_input`'s tensor, measured
    in the pipeline launch itself."""
    import torch.distributed as dist

    t = _stage_input(args, kind, mb)
    rank, rtts = dist.get_rank(), []
    for i in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        if i >= 2:
            rtts.append(time.perf_counter() - t0)
    return statistics.median(rtts) / 2


def profile_own_stages(args, kind: str, m: int, mbs: list, sim_schedule: str) -> dict:
    """A pipeline launch, after training: every rank times the model stages it holds in `sim_schedule`'s layout,
    all ranks at once (as busy as the machine is during the pipeline). {"n": [per model stage]}."""
    import torch.distributed as dist

    n, mine = held_stages(sim_schedule, dist.get_rank())
    x, y = mbs[0]
    local = {s: time_stage(args, kind, m, n, s, x, y) for s in mine}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {k: v for d in gathered for k, v in d.items()}
    return {str(n): [merged[s] for s in range(n)]}


def worker(args) -> int:
    import torch.distributed as dist
    from _systems import all_gather_floats

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    meta = {k: getattr(args, k) for k in ("label", "system", "schedule", "model", "precision", "steps", "warmup",
                                          "repeat")}
    meta.update(m=args.n_micro, world_size=world, micro_batch=micro_batch_of(args, args.model))
    total = args.warmup + args.steps
    try:
        mbs = load_data(args.data, args.model, args.precision, total, args.n_micro)
        timer = Timer()
        runner = RUNNERS[args.system](args, args.model, args.n_micro, timer)
        step_s, opt_s, span_s, losses, send_s, sends, recv_s = [], [], [], [], [], [], []
        kind_s = {k: [] for k in KINDS}
        for i in range(total):
            dist.barrier()
            timer.reset()
            t0 = time.perf_counter()
            loss = runner.train_step(mbs[i])
            step_s.append(time.perf_counter() - t0)
            for k in KINDS:
                kind_s[k].append(timer.seconds[k])
            opt_s.append(timer.seconds["opt"])
            send_s.append(timer.seconds["send"])
            recv_s.append(timer.seconds["recv"])
            sends.append(float(timer.calls["send"]))
            span_s.append(timer.opt_start - t0 if timer.opt_start is not None else step_s[-1])
            losses.append(loss)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
        steps_r, opt_r, span_r, loss_r, send_r, sends_r, recv_r = (
            all_gather_floats(v) for v in (step_s, opt_s, span_s, losses, send_s, sends, recv_s))
        kinds_r = {k: all_gather_floats(v) for k, v in kind_s.items()}  # [rank][step]
        per_rank = all_gather_floats([rss, float(runner.n_params)])
        # whether the engine ran every backward as its two passes (zerospeed's "split_backward", as resolved)
        split = getattr(getattr(runner, "engine", None), "_split", False) is True
        result = {"status": "ok", "n_params": int(sum(r[1] for r in per_rank)), "split_backward": split,
                  "step_s": [max(r[i] for r in steps_r) for i in range(total)],
                  # the pipeline: from the step's start (after a barrier) to the last rank's optimizer step
                  "pipeline_s": [max(r[i] for r in span_r) for i in range(total)],
                  "compute_s": [[sum(kinds_r[k][r][i] for k in KINDS) for i in range(total)] for r in range(world)],
                  **{f"{k}_s": v for k, v in kinds_r.items()}, "opt_s": opt_r, "losses": loss_r[0],
                  "send_s": send_r, "sends": sends_r, "recv_s": recv_r, "span_s": span_r,
                  "peak_rss_bytes": [r[0] for r in per_rank]}
        sim = SIM_SCHEDULE.get((args.system, args.schedule))
        if args.system == "reference":
            result["stage_times"] = profile_stages(args, args.model, args.n_micro, mbs[0])
        elif sim:
            result["stage_times"] = profile_own_stages(args, args.model, args.n_micro, mbs[0], sim)
            result["send_latency_s"] = message_latency(args, args.model, micro_batch_of(args, args.model))
        code = 0
    except Exception as e:  # noqa: BLE001 - a refusal or failure is a table row
        result = {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(result["traceback"], file=sys.stderr, flush=True)
        code = 1
    if rank == 0 or result["status"] != "ok":
        path = Path(args.result) if rank == 0 else Path(f"{args.result}.rank{rank}")
        tmp = path.parent / f"{path.name}.tmp"
        tmp.write_text(json.dumps({**meta, **result}))
        tmp.replace(path)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001, S110 - the result is written; a failing teardown changes nothing
        pass
    return code


# -- parent ------------------------------------------------------------------------------------------------
def _csv(s: str) -> list[str]:
    return [v.strip() for v in s.split(",") if v.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,gpt", help="comma list of mlp, gpt")
    p.add_argument("--precisions", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument("--microbatches", default="4,8", help="micro-batches per step (m), comma list")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--schedules", default=",".join(ALL_SCHEDULES),
                   help="comma list of schedules to run, of every system ('-' is the one process)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=32, help="samples per micro-batch, mlp")
    p.add_argument("--gpt-micro-batch", type=int, default=4, help="sequences per micro-batch, gpt")
    p.add_argument("--mlp-layers", type=int, default=8)
    p.add_argument("--mlp-hidden", type=int, default=1024)
    p.add_argument("--mlp-ffn", type=int, default=1536)
    p.add_argument("--gpt-size", default="small", help="a key of zerospeed.testing.models.GPT_SIZES")
    p.add_argument("--gpt-layers", type=int, default=8, help="GPT blocks (0: the size's own; small has 6)")
    p.add_argument("--profile-reps", type=int, default=5, help="timed repetitions per stage for the simulator")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--forward-reseed", type=int, default=0,
                   help="1: keep seed_layers' re-seeding before every layer of every forward (zerospeed, DeepSpeed)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + " (flags still override)")
    p.add_argument("--zerospeed-ref", default=None, help="benchmark zerospeed as committed at this git ref")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--report", metavar="JSON", default=None, help="re-render a saved bench_pipe_<stamp>.json")
    # worker side
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--label", "--system", "--schedule", "--model", "--precision", "--data", "--result"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--n-micro", "--repeat"):
        p.add_argument(flag, type=int, default=0, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.quick:  # quick defaults, unless the flag was given
        given = {a.split("=")[0] for a in argv if a.startswith("--")}
        for k, v in QUICK.items():
            if "--" + k.replace("_", "-") not in given:
                setattr(args, k, v)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")
    return args


def configurations(args) -> list[tuple]:
    systems, schedules = set(_csv(args.systems)), set(_csv(args.schedules))
    return [c for c in CONFIGS if c[1] in systems and c[2] in schedules]


def run_all(args, logs: Path, data: dict, pythonpath: str | None) -> tuple[list[dict], bool]:
    from bench_zero import _log_tail, launch

    configs = configurations(args)
    models, precisions, ms = _csv(args.models), _csv(args.precisions), [int(v) for v in _csv(args.microbatches)]
    groups = [(k, pr, m) for k in models for pr in precisions for m in ms]
    runs, failed, k = [], {}, 0
    n = len(groups) * len(configs) * args.repeats
    try:
        for rep in range(args.repeats):
            for kind, precision, m in groups:
                order = configs[rep % len(configs):] + configs[:rep % len(configs)]
                for label, system, schedule, world in order:
                    k += 1
                    key = (kind, precision, m, label)
                    if key in failed:  # a refusal does not change between repeats: launched once
                        print(f"[{k}/{n}] {kind} {precision} m={m} {label}: failed in an earlier repeat, not "
                              f"relaunched", file=sys.stderr, flush=True)
                        continue
                    tag = f"{kind}_{precision}_m{m}_{system}_{schedule.replace('-', 'one')}_r{rep}"
                    result = logs / f"{tag}.json"
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), str(Path(__file__).resolve()), "--worker", "--label", label, "--system", system,
                           "--schedule", schedule, "--model", kind, "--precision", precision, "--n-micro", str(m),
                           "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeat", str(rep),
                           "--micro-batch", str(args.micro_batch), "--gpt-micro-batch", str(args.gpt_micro_batch),
                           "--mlp-layers", str(args.mlp_layers), "--mlp-hidden", str(args.mlp_hidden),
                           "--mlp-ffn", str(args.mlp_ffn), "--gpt-size", args.gpt_size,
                           "--gpt-layers", str(args.gpt_layers),
                           "--profile-reps", str(args.profile_reps), "--seed", str(args.seed),
                           "--forward-reseed", str(args.forward_reseed),
                           "--timeout", str(args.timeout), "--data", str(data[kind]), "--result", str(result)]
                    load = os.getloadavg()[0]
                    code, wall = launch(cmd, logs / f"{tag}.log", args.timeout, pythonpath)
                    if result.exists():
                        run = json.loads(result.read_text())
                    else:
                        errs = sorted(logs.glob(f"{tag}.json.rank*"))
                        if errs:
                            run = json.loads(errs[0].read_text())
                        else:
                            why = "timed out" if code is None else f"exit code {code}"
                            run = {"status": "error", "message": f"{why}: {_log_tail(logs / f'{tag}.log')}"}
                    run.update(label=label, system=system, schedule=schedule, model=kind, precision=precision, m=m,
                               world_size=world, repeat=rep, load_avg_1min=load, wall_s=wall,
                               micro_batch=micro_batch_of(args, kind), warmup=args.warmup)
                    run.pop("traceback", None)
                    if run["status"] != "ok":
                        failed[key] = True
                    runs.append(run)
                    what = (f"{samples_per_s(run):,.1f} samples/s, step "
                            f"{statistics.median(run['step_s'][args.warmup:]):.3f} s"
                            if run["status"] == "ok" else f"{run['status']}: {run.get('message', '')[:160]}")
                    print(f"[{k}/{n}] {kind} {precision} m={m} {label} repeat {rep + 1}: {what} ({wall:.0f} s, "
                          f"load {load:.1f})", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("bench_pipe: interrupted; reporting the runs finished so far", file=sys.stderr)
        return runs, True
    return runs, False


def samples_per_s(run: dict) -> float:
    return run["micro_batch"] * run["m"] / statistics.median(run["step_s"][run["warmup"]:])


def measured_bubble(run: dict) -> float | None:
    """Median over timed steps of 1 - sum_r compute_r / (p x pipeline), pipeline = from the step's start to the
    last rank's optimizer step (the makespan the simulator predicts)."""
    if run["world_size"] < 2:
        return None
    out = []
    ranks = len(run["compute_s"])
    for i in range(run["warmup"], len(run["step_s"])):
        span = run["pipeline_s"][i]
        if span > 0:
            out.append(1.0 - sum(r[i] for r in run["compute_s"]) / (ranks * span))
    return statistics.median(out) if out else None


def _stage_table(profiles: list[dict]) -> dict:
    """The median over repeats of every stage time: {"2": [...], "4": [...]} (the keys the launches have)."""
    return {n: [{k: statistics.median(p[n][s][k] for p in profiles) for k in profiles[0][n][s]}
                for s in range(len(profiles[0][n]))] for n in profiles[0]}


def _plan(name: str, m: int):
    from zerospeed.pipe import build_schedule

    chunks, layout = LAYOUT[name]
    return build_schedule(name, P, m, chunks=chunks, layout=layout)


def simulate_times(name: str, m: int, forward, backward, weight, latency: float = 0.0, overhead: float = 0.0,
                   pass_overhead: float = 0.0):
    """(simulated pipeline seconds, simulated bubble) of zerospeed schedule `name` at p=P, m, with per-rank
    seconds per micro-batch (each the sum over the rank's chunks): `backward` is the fused backward for a
    schedule without a split (then `weight` is added to it), the input-gradient pass for one with; `latency` and
    `overhead` the simulator's send_latency and send_overhead, `pass_overhead` its pass_overhead."""
    from zerospeed.pipe import StageTimes
    from zerospeed.pipe.schedule import BackwardInput
    from zerospeed.pipe.simulate import simulate

    plan = _plan(name, m)
    if not any(isinstance(a, BackwardInput) for acts in plan.values() for a in acts):
        backward, weight = [b + w for b, w in zip(backward, weight)], [0.0] * P
    res = simulate(plan, StageTimes(forward=list(forward), backward_input=list(backward),
                                    backward_weight=list(weight), send_latency=latency, send_overhead=overhead,
                                    pass_overhead=pass_overhead))
    return res.step_time, res.bubble_fraction


def splits_every_backward(row: dict) -> bool:
    """Whether a row's engine ran every backward as its two passes (recorded by the worker from the zerospeed
    engine; runs from before it was recorded: zerospeed's "auto" rule then, fp32 at ZeRO 0 but "1f1b_fused")."""
    if "split_backward" in row:
        return row["split_backward"]
    return row["system"] == "zerospeed" and row["precision"] == "fp32" and row["schedule"] != "1f1b_fused"


def simulate_row(stage_times: dict, name: str, m: int, fused: bool = False, latency: float = 0.0,
                 overhead: float = 0.0, pass_overhead: float = 0.0, split_backward: bool = False):
    """`simulate_times` from per-model-stage times (`time_stage`), summed per rank over its model stages; the
    split times for a split schedule or `split_backward` (zerospeed's default: every backward as its two
    passes) unless `fused` (a system that keeps W inside its backward: DeepSpeed)."""
    from zerospeed.pipe.schedule import BackwardInput

    n, _ = held_stages(name, 0)
    rows = stage_times[str(n)]
    held = {r: held_stages(name, r)[1] for r in range(P)}
    split = split_backward or any(isinstance(a, BackwardInput) for acts in _plan(name, m).values() for a in acts)

    def per_rank(key):
        return [sum(rows[s][key] for s in held[r]) for r in range(P)]

    if split and not fused:
        return simulate_times(name, m, per_rank("forward"), per_rank("backward_input"), per_rank("backward_weight"),
                              latency, overhead, pass_overhead)
    return simulate_times(name, m, per_rank("forward_fused"), per_rank("backward_fused"), [0.0] * P, latency,
                          overhead, pass_overhead)


def in_run_times(ok: list[dict]) -> list[list[float]]:
    """[forward, backward, weight] per rank: seconds per micro-batch inside the run's own calls (median over the
    timed steps and repeats of the step's total / m)."""
    w, m = ok[0]["warmup"], ok[0]["m"]
    ranks = len(ok[0]["forward_s"])
    return [[statistics.median(statistics.median(r[f"{k}_s"][rank][w:]) for r in ok) / m for rank in range(ranks)]
            for k in KINDS]


def send_overhead(ok: list[dict]) -> float | None:
    """Seconds per send call (zerospeed's activation and gradient sends, timed in the run): the timed steps' send
    seconds over their sends, per rank; the median over ranks and repeats. None without sends timed."""
    w, per = ok[0]["warmup"], []
    for r in ok:
        for secs, count in zip(r.get("send_s") or [], r.get("sends") or []):
            if sum(count[w:]):
                per.append(sum(secs[w:]) / sum(count[w:]))
    return statistics.median(per) if per else None


def pass_overhead(ok: list[dict], name: str) -> float | None:
    """Seconds of the executor's own work per computation (zerospeed): per rank and timed step, the rank's
    pipeline span minus its compute, send and receive/wait seconds, over its computations in schedule `name`;
    the median over ranks, steps and repeats. None without the receive timer (other systems, older runs)."""
    from zerospeed.pipe.schedule import COMPUTE

    if not ok[0].get("recv_s") or not ok[0].get("span_s"):
        return None
    plan = _plan(name, ok[0]["m"])
    w, per = ok[0]["warmup"], []
    for r in ok:
        for rank, span in enumerate(r["span_s"]):
            n = sum(isinstance(a, COMPUTE) for a in plan[rank])
            for i in range(w, len(span)):
                busy = span[i] - r["send_s"][rank][i] - r["recv_s"][rank][i]
                per.append(max(0.0, busy - r["compute_s"][rank][i]) / n)
    return statistics.median(per)


def aggregate(runs: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["model"], r["precision"], r["m"], r["label"]), []).append(r)
    rows = []
    for (kind, precision, m, label), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        first = rs[0]
        row = {"model": kind, "precision": precision, "m": m, "label": label, "system": first["system"],
               "schedule": first["schedule"], "repeats": len(ok), "status": "ok" if ok else first["status"],
               "message": first.get("message", "")}
        if ok:
            w = ok[0]["warmup"]
            ranks = len(ok[0]["peak_rss_bytes"])
            bubbles = [b for b in (measured_bubble(r) for r in ok) if b is not None]
            row.update(
                n_params=ok[0]["n_params"], micro_batch=ok[0]["micro_batch"],
                samples_per_s=statistics.median(samples_per_s(r) for r in ok),
                samples_per_s_all=[samples_per_s(r) for r in ok],
                step_s=statistics.median(statistics.median(r["step_s"][w:]) for r in ok),
                pipeline_s=statistics.median(statistics.median(r["pipeline_s"][w:]) for r in ok),
                # the fastest rank's optimizer call: the other one's may include waiting for it in the gradient
                # norm's all-reduce over the pipe group (zerospeed; DeepSpeed's bf16 optimizer)
                opt_s=statistics.median(statistics.median(min(rk[i] for rk in r["opt_s"])
                                                          for i in range(w, len(r["step_s"]))) for r in ok),
                compute_s=[statistics.median(statistics.median(r["compute_s"][k][w:]) for r in ok)
                           for k in range(ranks)],
                bubble=statistics.median(bubbles) if bubbles else None,
                peak_rss_mib=[statistics.median(r["peak_rss_bytes"][k] for r in ok) / MiB for k in range(ranks)],
                final_loss=statistics.median(r["losses"][-1] for r in ok), losses=ok[0]["losses"],
                load=[r["load_avg_1min"] for r in ok])
            if ok[0].get("stage_times"):
                row["stage_times"] = _stage_table([r["stage_times"] for r in ok])
            if ok[0].get("send_latency_s") is not None:
                row["send_latency_s"] = statistics.median(r["send_latency_s"] for r in ok)
            if ranks > 1 and "forward_s" in ok[0]:
                row["in_run_times"] = in_run_times(ok)
            row["send_overhead_s"] = send_overhead(ok)
            if "split_backward" in ok[0]:
                row["split_backward"] = ok[0]["split_backward"]
        rows.append(row)
    by = {(r["model"], r["precision"], r["m"], r["label"]): r for r in rows if r["status"] == "ok"}
    for row in rows:
        row["ideal_bubble"] = (P - 1) / (row["m"] + P - 1)
        if row["status"] != "ok":
            continue
        ref = by.get((row["model"], row["precision"], row["m"], "one process"))
        row["vs_one"] = row["samples_per_s"] / ref["samples_per_s"] if ref and ref is not row else None
        row["dloss"] = row["final_loss"] - ref["final_loss"] if ref and ref is not row else None
        sim = SIM_SCHEDULE.get((row["system"], row["schedule"]))
        row["sim_schedule"] = sim
        if not sim:
            continue
        try:  # stage times profiled in this launch (both ranks busy); the one process's; the run's own calls
            # which stage times: zerospeed splits every backward (but "1f1b_fused"); DeepSpeed fuses them
            fused = row["system"] == "deepspeed" or row["schedule"] == "1f1b_fused"
            latency = row.get("send_latency_s") or 0.0  # measured in the launch; 0 in runs from before
            overhead = row.get("send_overhead_s") or 0.0  # zerospeed's sends, timed in the run; 0 for the others
            if row["system"] == "zerospeed":
                row["pass_overhead_s"] = pass_overhead([r for r in runs if r.get("label") == row["label"] and
                                                        r["model"] == row["model"] and r["precision"] ==
                                                        row["precision"] and r["m"] == row["m"] and
                                                        r["status"] == "ok"], sim)
            per_pass = row.get("pass_overhead_s") or 0.0
            if row.get("stage_times"):
                step, bubble = simulate_row(row["stage_times"], sim, row["m"], fused, latency, overhead, per_pass,
                                            splits_every_backward(row))
                row["sim_pipeline_s"], row["sim_bubble"] = step, bubble
                row["sim_error"] = step / row["pipeline_s"] - 1.0
            if ref and ref.get("stage_times"):
                step, _ = simulate_row(ref["stage_times"], sim, row["m"], fused, latency, overhead, per_pass,
                                       splits_every_backward(row))
                row["sim_ref_pipeline_s"], row["sim_ref_error"] = step, step / row["pipeline_s"] - 1.0
            if row.get("in_run_times"):
                step, bubble = simulate_times(sim, row["m"], *row["in_run_times"], latency, overhead, per_pass)
                row["sim_run_pipeline_s"], row["sim_run_bubble"] = step, bubble
                row["sim_run_error"] = step / row["pipeline_s"] - 1.0
        except Exception as e:  # noqa: BLE001 - a table cell, not a crash
            row["sim_error_message"] = f"{type(e).__name__}: {e}"
    return rows


def _f(x, spec, none="—"):
    return none if x is None else format(x, spec)


HEADER = ("| model | prec | m | system | step s | samples/s | vs one process | pipeline s | pipeline simulated s "
          "(error) | error, stage times timed alone | error, one-process stage times | ms per send (call / latency) / per "
          "pass | "
          "bubble measured | bubble simulated | (p-1)/(m+p-1) | optimizer s | compute s/rank (F+B+W per "
          "micro-batch, ms) | peak RSS/rank MiB | final loss | Δ vs one process |")


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:+.0f}%"


def markdown_table(rows: list[dict]) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count(" | ") + 1)]
    for r in rows:
        head = f"| {r['model']} | {r['precision']} | {r['m']} | {r['label']} |"
        if r["status"] != "ok":
            msg = (r.get("message") or "").splitlines()[0][:200].replace("|", "/") if r.get("message") else ""
            lines.append(f"{head} {r['status']}: {msg} |" + " — |" * (HEADER.count(" | ") - 4))
            continue
        sim = (f"{r['sim_run_pipeline_s']:.3f} ({_pct(r['sim_run_error'])})" if r.get("sim_run_pipeline_s") is not None
               else ("error: " + r["sim_error_message"][:80] if r.get("sim_error_message") else "—"))
        send = (f"{1e3 * (r.get('send_overhead_s') or 0):.2f} / {1e3 * r['send_latency_s']:.2f} / "
                f"{_f(None if r.get('pass_overhead_s') is None else 1e3 * r['pass_overhead_s'], '.2f')}"
                if r.get("send_latency_s") is not None else "—")
        vs_one = "—" if r["vs_one"] is None else f"{r['vs_one']:.2f}x"
        pipeline = "—" if r["label"] == "one process" else f"{r['pipeline_s']:.3f}"
        compute = " / ".join(f"{c:.3f}" for c in r["compute_s"])
        if r.get("in_run_times"):
            f, b, w = r["in_run_times"]
            compute += " (" + " / ".join(f"{1e3 * f[k]:.1f}+{1e3 * b[k]:.1f}+{1e3 * w[k]:.1f}"
                                         for k in range(len(f))) + ")"
        lines.append(
            f"{head} {r['step_s']:.3f} | {r['samples_per_s']:,.1f} | {vs_one} | {pipeline} | {sim} | "
            f"{_pct(r.get('sim_error'))} | {_pct(r.get('sim_ref_error'))} | {send} | "
            f"{_f(r['bubble'], '.3f')} | {_f(r.get('sim_run_bubble'), '.3f')} | {r['ideal_bubble']:.3f} | "
            f"{r['opt_s']:.3f} | {compute} | {' / '.join(f'{v:,.0f}' for v in r['peak_rss_mib'])} | "
            f"{r['final_loss']:.4f} | {_f(r['dloss'], '+.1e')} |")
    return "\n".join(lines)


def floor_samples_per_s(r: dict) -> float | None:
    """The samples/s row `r` would reach with no idle time its schedule can avoid, at its own measured compute:
    the busiest rank's compute seconds per step divided by (1 - the schedule's ideal bubble) - 1F1B and GPipe
    (p-1)/(m+p-1), interleaved 1F1B (p-1)/(2m+p-1) - or, for the zero-bubble schedules (zb_h1, zb_v,
    dualpipev), plus one forward of the first rank's first chunk (the next rank cannot start before it), then
    the step's time outside the pipeline (optimizer, loss reduction) added. None without the compute timings."""
    if r.get("status") != "ok" or not r.get("compute_s") or r["label"] == "one process":
        return None
    p, m, busiest = len(r["compute_s"]), r["m"], max(r["compute_s"])
    schedule = r["schedule"]
    if schedule in ("zb_h1", "zb_v", "dualpipev"):
        if not r.get("in_run_times"):
            return None
        chunks = LAYOUT.get(schedule, (1, ""))[0]
        pipeline = busiest + r["in_run_times"][0][0] / chunks
    else:
        v = 2 if schedule == "interleaved_1f1b" else 1
        pipeline = busiest / (1 - (p - 1) / (v * m + p - 1))
    return r["micro_batch"] * m / (r["step_s"] - r["pipeline_s"] + pipeline)


def targets_table(rows: list[dict]) -> str:
    """Issue 24's targets per (model, precision, m), each with its limit: the ratio with the zerospeed side at
    `floor_samples_per_s` (for "best": the best such zerospeed row) and the other side as measured."""
    lines = ["| model | prec | m | target | value | met | limit (zerospeed at its schedule's floor) |",
             "|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["model"], r["precision"], r["m"]) for r in rows))  # in the table's order
    for key in keys:
        ok = {r["label"]: r for r in rows if (r["model"], r["precision"], r["m"]) == key and r["status"] == "ok"}
        where = " | ".join(map(str, key))
        sps = {label: r["samples_per_s"] for label, r in ok.items()}
        best = {}
        for system in ("zerospeed", "deepspeed", "torch"):
            cands = [(r["samples_per_s"], label) for label, r in ok.items() if r["system"] == system]
            best[system] = max(cands) if cands else (None, None)

        floors = {label: floor_samples_per_s(r) for label, r in ok.items() if r["system"] == "zerospeed"}
        best_floor = max((f for f in floors.values() if f is not None), default=None)

        def ratio(target: str, num, den, goal: float, floor=None, where=where) -> str:
            if num is None or den is None:
                return f"| {where} | {target} | n/a | — | — |"
            limit = "—" if floor is None else f"{floor / den:.2f}x"
            return f"| {where} | {target} | {num / den:.2f}x | {'yes' if num / den >= goal else 'no'} | {limit} |"

        lines.append(ratio("zerospeed 1F1B >= 1.10x DeepSpeed 1F1B", sps.get("zerospeed 1f1b"),
                           sps.get("DeepSpeed 1F1B"), 1.10, floors.get("zerospeed 1f1b")))
        zbv, ds_dpv = sps.get("zerospeed zb_v"), sps.get("DeepSpeed DualPipeV")
        if sps.get("zerospeed dualpipev") is not None:
            lines.append(ratio("zerospeed DualPipeV >= 1.10x DeepSpeed DualPipeV", sps["zerospeed dualpipev"],
                               ds_dpv, 1.10, floors.get("zerospeed dualpipev")))
        else:  # not run, failed, or a zerospeed without it: zb_v is the closest (the same V of 2 chunks)
            why = next((r["status"] for r in rows if (r["model"], r["precision"], r["m"]) == key
                        and r["label"] == "zerospeed dualpipev"), "not run")
            note = f"; zerospeed zb_v ÷ DeepSpeed DualPipeV = {zbv / ds_dpv:.2f}x" if zbv and ds_dpv else ""
            lines.append(f"| {where} | zerospeed DualPipeV >= 1.10x DeepSpeed DualPipeV | {why}{note} | — | — |")
        (bz, bz_label), (bd, bd_label), (bt, bt_label) = best["zerospeed"], best["deepspeed"], best["torch"]
        lines.append(ratio(f"best zerospeed ({bz_label}) >= 1.20x best DeepSpeed ({bd_label})", bz, bd, 1.20,
                           best_floor))
        lines.append(ratio(f"best zerospeed ({bz_label}) >= 1.05x best torch ({bt_label})", bz, bt, 1.05, best_floor))
        errs = [(abs(r["sim_run_error"]), label) for label, r in ok.items()
                if r["system"] == "zerospeed" and r.get("sim_run_error") is not None]
        target = "simulator within 10% of the measured pipeline time (every zerospeed schedule)"
        if errs:
            worst = max(errs)
            lines.append(f"| {where} | {target} | worst {100 * worst[0]:.0f}% ({worst[1]}) | "
                         f"{'yes' if worst[0] <= 0.10 else 'no'} | — |")
        else:
            lines.append(f"| {where} | {target} | n/a | — | — |")
    return "\n".join(lines)


def stage_times_table(rows: list[dict]) -> str:
    head = ("| model | prec | m | measured in | model stages | stage | forward ms | input grad ms | weight grad ms | "
            "fused forward ms | fused backward ms |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:  # the one process's and zerospeed's (DeepSpeed's and torch's launches: in the JSON)
        if not r.get("stage_times") or r["system"] not in ("reference", "zerospeed"):
            continue
        for n, stages in r["stage_times"].items():
            for s, t in enumerate(stages):
                lines.append(f"| {r['model']} | {r['precision']} | {r['m']} | {r['label']} | {n} | {s} | "
                             f"{1e3 * t['forward']:.1f} | {1e3 * t['backward_input']:.1f} | "
                             f"{1e3 * t['backward_weight']:.1f} | {1e3 * t['forward_fused']:.1f} | "
                             f"{1e3 * t['backward_fused']:.1f} |")
    return "\n".join(lines)


NOTES = ("samples/s = micro-batch x m / median step (slowest rank, after a barrier); medians over repeats. "
         "pipeline s = from the step's start to the last rank's optimizer step (the step minus the optimizer and "
         "the loss's reduction). Bubble measured = 1 - Σ_ranks compute / (p x pipeline), compute timed inside the "
         "forward, backward and loss calls; (p-1)/(m+p-1) is 1F1B's ideal with one chunk per rank. Pipeline and "
         "bubble simulated = zerospeed.pipe.simulate, for the zerospeed schedule of the same order (DeepSpeed and "
         "torch rows: approximate, zerospeed's schedule), on each rank's forward + backward + weight seconds per "
         "micro-batch timed inside this run's own calls (the compute column), the activation message latency "
         "measured in the launch and, for zerospeed, the seconds per send call timed in the run and the executor's "
         "own seconds per pass (each rank's span minus its compute, send and receive/wait seconds, over its "
         "computations: posting receives, hand-offs, bookkeeping; counted as busy); error against the measured "
         "pipeline s (the target's number). 'stage times timed alone': the "
         "same prediction on the stage times below, which this launch measured after training (each rank its own "
         "model stages, both ranks at once; zerospeed's stage code); 'one-process stage times': on the one-process "
         "launch's (one rank busy). Those two also measure how well a stage timed alone predicts that stage inside "
         "the pipeline, which on this shared machine drifts by up to 30% between launches. optimizer s: the "
         "fastest rank's optimizer call (the other "
         "one's can include waiting for it in the gradient norm's all-reduce over the pipe group). Peak RSS: "
         "ru_maxrss per rank (one process: the whole model in one process). Δ vs one process: final loss minus "
         "the one-process final loss (same data and initial weights; bf16 rows differ by rounding, torch bf16 is "
         "autocast over fp32 weights).")


def report(saved: dict, base: Path) -> str:
    a = saved["args"]
    rows = aggregate(saved["runs"])
    order = {c[0]: i for i, c in enumerate(CONFIGS)}
    models = _csv(a["models"])
    rows.sort(key=lambda r: (models.index(r["model"]) if r["model"] in models else 9,
                             ("fp32", "bf16").index(r["precision"]) if r["precision"] in ("fp32", "bf16") else 9,
                             r["m"], order.get(r["label"], 99)))
    loads = [r["load_avg_1min"] for r in saved["runs"]]
    params = {r["model"]: r["n_params"] for r in rows if r.get("n_params") and r["label"] == "one process"}
    shapes = {"mlp": f"mlp {a['mlp_layers']} x (Linear {a['mlp_hidden']}->{a['mlp_ffn']}, ReLU, Linear "
                     f"{a['mlp_ffn']}->{a['mlp_hidden']}), micro-batch {a['micro_batch']}",
              "gpt": f"gpt {a['gpt_size']} with {a.get('gpt_layers') or 'its'} blocks (embedding, blocks, head as "
                     f"LayerSpecs, type:GPTBlock partition), micro-batch "
                     f"{a['gpt_micro_batch']} sequences"}
    header = (f"bench_pipe {saved['stamp']}: p = {P} pipeline stages (2 ranks, gloo, 1 thread per rank); "
              + "; ".join(f"{shapes[k]}{f' ({params[k] / 1e6:.1f}M parameters)' if k in params else ''}"
                          for k in _csv(a["models"]))
              + f"; {a['warmup']} warm-up + {a['steps']} timed steps, {a['repeats']} interleaved repeat(s) (medians), "
              f"AdamW lr 1e-4, no clipping; torch {saved['torch']}, deepspeed {saved.get('deepspeed') or 'n/a'}, "
              f"{saved['cpu']}; 1-min load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f} during the "
              f"runs; {saved['elapsed_s'] / 60:.1f} min in all. zerospeed: {saved['zerospeed_source']}.")
    md = (f"{header}\n\n{markdown_table(rows)}\n\n{NOTES}\n\n### Targets (issue 24)\n\n{targets_table(rows)}\n\n"
          f"### Stage times (one micro-batch, each model stage built alone; the simulator's input; DeepSpeed's and "
          f"torch's launches in the JSON)\n\n"
          f"{stage_times_table(rows)}\n")
    if saved.get("interrupted"):
        md += "\nInterrupted: incomplete.\n"
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
    import signal
    import tempfile

    from bench_zero import _cpu_name, _interrupt, zerospeed_source

    signal.signal(signal.SIGTERM, _interrupt)
    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = Path(args.out)
    logs = out / f"logs_pipe_{stamp}"
    logs.mkdir(parents=True)
    ds_version = None
    if "deepspeed" in _csv(args.systems):
        if importlib.util.find_spec("deepspeed") is None:
            print("bench_pipe: deepspeed is not importable: its rows are left out", file=sys.stderr)
            args.systems = ",".join(s for s in _csv(args.systems) if s != "deepspeed")
        else:
            from importlib.metadata import version

            ds_version = version("deepspeed")
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="bench_pipe_"))
    try:
        total = args.warmup + args.steps
        m_max = max(int(v) for v in _csv(args.microbatches))
        data = {}
        for kind in _csv(args.models):
            data[kind] = tmp / f"data_{kind}.pt"
            write_data(data[kind], kind, args, total, m_max)
        pythonpath, source = zerospeed_source(args.zerospeed_ref, tmp / "zerospeed_src")
        print(f"bench_pipe: zerospeed from {source}; logs in {logs}", file=sys.stderr, flush=True)
        runs, interrupted = run_all(args, logs, data, pythonpath)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    saved = {"stamp": stamp, "args": {k: v for k, v in vars(args).items() if k not in ("worker",)},
             "elapsed_s": time.time() - t0, "torch": torch.__version__, "deepspeed": ds_version, "cpu": _cpu_name(),
             "zerospeed_source": source, "interrupted": interrupted, "runs": runs}
    print(report(saved, out / f"bench_pipe_{stamp}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
