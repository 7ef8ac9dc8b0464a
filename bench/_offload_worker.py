"""One offload benchmark run, on every rank (started by `bench_offload.py` through torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/_offload_worker.py \
        --system zerospeed --mode nvme --model base --nvme-path DIR --data batches.pt --result out.json

ZeRO stage 3, AdamW (bench/_systems.py's settings), fp32 or (`@bf16` after the model name) bf16,
`--mode` mem | cpu | nvme (optimizer and parameters both in memory / host / NVMe). `--model base` is
zerospeed.testing's GPT (built whole on every rank after the seed, as in bench_zero.py); `--model
big:LxD` is `InitGPT` (L blocks of width D, untied head) built under `zerospeed.zero.Init()` /
`deepspeed.zero.Init(config_dict_or_path=cfg)` so no rank ever holds the whole model (with NVMe:
`remote_device="nvme"`, the slices on disk too). `--ckpt`: activation checkpointing of every block
(`zerospeed.checkpointing.checkpoint` / `deepspeed.checkpointing.checkpoint`). `--param-buffers`,
`--pipeline`: offload_param.buffer_count and the optimizer's pipeline_read/write. Rank 0 writes one JSON object: per-step wall / CPU times
(max over ranks), losses, peak and start RSS of every rank, and per rank the disk bytes of the
timed steps (/proc/self/io read_bytes / write_bytes, both systems) and, for zerospeed, the counters
of `engine.offload.aio` plus the time at least one of its requests was in flight (`busy_s`), and
the peak of the current RSS (sampled every 20 ms) in each phase: build, initialize, train.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _systems import _ds_config, _EngineRunner, all_gather_floats  # noqa: E402
from _worker import peak_rss_bytes, publish  # noqa: E402

from zerospeed.testing.models import GPT, GPT_SIZES, GPTConfig  # noqa: E402


def InitGPT(cfg: GPTConfig) -> GPT:  # noqa: N802 - named like the class it builds
    """zerospeed.testing's GPT with every weight initialised by its own layer's constructor (PyTorch
    defaults), so it can be built under ZeRO-3 Init; untie the head in `cfg` for DeepSpeed's Init."""
    return GPT(cfg, init_weights=False)


def split_model(name: str) -> tuple[str, str]:
    """'big:52x2560@bf16' -> ('big:52x2560', 'bf16'); no '@': fp32; a '+variant' suffix is dropped."""
    model, _, precision = name.partition("+")[0].partition("@")
    return model, precision or "fp32"


def variants(name: str) -> set[str]:
    """'big:52x2560@bf16+super' -> {'super'}: offload_optimizer.super_offload (the step in the backward;
    bf16 then without check_grad_overflow, which would keep the step at engine.step()). '+nourgent' (an A/B
    of zerospeed's I/O, not a setting): parameter-shard reads queue behind the other transfers. '+nodefer' (an
    A/B too): super_offload steps every layer in the backward, none in the next forward. '+pendingN' / '+setsN' (A/B
    too): super_offload's in-memory gradients held / buffer sets (offload.budget.BACKWARD_PENDING / BACKWARD_SETS)."""
    return set(name.split("+")[1:])


def _no_urgent_reads() -> None:
    from zerospeed.offload.swap import SwapSpace

    read = SwapSpace.read
    SwapSpace.read = lambda self, key, into, offset=0, urgent=False: read(self, key, into, offset)


def model_config(name: str, seq_len: int) -> GPTConfig:
    """'base' -> GPT_SIZES['base']; 'big:LxD' -> L layers of width D (D/128 heads), no bias, untied."""
    name = split_model(name)[0]
    if name in GPT_SIZES:
        return GPT_SIZES[name]
    layers, width = (int(v) for v in name.split(":", 1)[1].split("x"))
    return GPTConfig(vocab_size=256, seq_len=seq_len, n_layer=layers, n_head=max(1, width // 128),
                     d_model=width, bias=False, tie_weights=False)


def offload_config(*, system: str, mode: str, micro: int, world: int, nvme_path: str, buffer_size: int,
                   precision: str = "fp32", param_buffers: int = 16, pipeline: bool = False,
                   aio_threads: int = 1, super_offload: bool = False) -> dict:
    """bench/_systems.py's stage-3 config plus the offload sections (the same for both systems)."""
    cfg = _ds_config(stage=3, precision=precision, micro_batch=micro, world_size=world, deepspeed=system == "deepspeed")
    zero = cfg["zero_optimization"]
    zero.update(sub_group_size=10_000_000)
    if mode == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
    elif mode == "nvme":
        # DeepSpeed 0.19.8's pipelined swapper fails its first step on these models (`assert new_alloc_buffers is
        # not None`, pipelined_optimizer_swapper.py:219): DeepSpeed runs its default, unpipelined
        pipeline = pipeline and system != "deepspeed"
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pipeline_read": pipeline,
                                     "pipeline_write": pipeline, "buffer_count": 4}
        # DeepSpeed holds one buffer per parameter in flight (prefetched ones included): with 5 buffers and
        # its default prefetch (5e7 elements) it fails ("Not enough buffers 0 for swapping 1")
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": param_buffers,
                                 "buffer_size": buffer_size, "max_in_cpu": 0}
        # ... and still with 16 buffers while it keeps parameters gathered for reuse (stage3_max_reuse_distance 1e9)
        zero.update(stage3_prefetch_bucket_size=buffer_size, stage3_max_reuse_distance=0)
        if super_offload:
            zero["offload_optimizer"]["super_offload"] = True
            if precision == "bf16":
                cfg["bf16"]["check_grad_overflow"] = False
        cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": aio_threads, "single_submit": False,
                      "overlap_events": True}
    if system == "deepspeed" and mode != "mem":
        cfg["zero_force_ds_cpu_optimizer"] = False  # keep torch AdamW (no JIT-built CPU Adam), as bench_zero
    return cfg


class _Busy:
    """Wall seconds during which at least one AsyncIO request of this process was in flight: any,
    reads only, writes only (`seconds`, `read_s`, `write_s`)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.inflight, self.since, self.secs = [0, 0, 0], [0.0] * 3, [0.0] * 3  # any, read, write
        self.wait_s = 0.0  # time the training thread spent blocked in IOHandle.wait()

    seconds = property(lambda self: self.secs[0])
    read_s = property(lambda self: self.secs[1])
    write_s = property(lambda self: self.secs[2])

    def busy_now(self) -> float:
        """`seconds` including the interval still open (a phase boundary inside a request)."""
        with self.lock:
            return self.secs[0] + (time.perf_counter() - self.since[0] if self.inflight[0] else 0.0)

    def _mark(self, kinds, delta):
        now = time.perf_counter()
        with self.lock:
            for k in kinds:
                self.inflight[k] += delta
                if delta > 0 and self.inflight[k] == 1:
                    self.since[k] = now
                elif delta < 0 and self.inflight[k] == 0:
                    self.secs[k] += now - self.since[k]

    def install(self):
        from zerospeed.offload import aio

        run, busy = aio.AsyncIO._run, self

        def timed_run(io, req, spans):
            kinds = (0, 2 if req.write else 1)
            busy._mark(kinds, 1)
            try:
                return run(io, req, spans)
            finally:
                busy._mark(kinds, -1)
        aio.AsyncIO._run = timed_run
        wait = aio.IOHandle.wait

        def timed_wait(handle):
            t = time.perf_counter()
            try:
                return wait(handle)
            finally:
                if threading.current_thread() is threading.main_thread():
                    busy.wait_s += time.perf_counter() - t
        aio.IOHandle.wait = timed_wait


def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process made the storage layer move so far (O_DIRECT included)."""
    vals = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(vals["read_bytes"]), int(vals["write_bytes"])


class _Phases:
    """Peak current RSS (/proc/self/statm, sampled every 20 ms by a thread) per named phase."""

    def __init__(self):
        self.phase, self.peaks, self._stop = "start", {}, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._stop.wait(0.02):
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.rss())

    def stop(self) -> dict:
        self._stop.set()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.rss())
        return self.peaks


def checkpoint_blocks(model, system: str) -> None:
    """Activation checkpointing of every transformer block (the block's forward hooks run again in the
    recomputation, so ZeRO-3 gathers its parameters there)."""
    if system == "deepspeed":
        import deepspeed

        checkpoint = deepspeed.checkpointing.checkpoint  # an attribute there, not an importable module path
    else:
        from zerospeed.checkpointing import checkpoint

    import functools

    from torch import nn

    cls = type(model.blocks[0])
    # one subclass with the same name: ZeRO-3 still finds the blocks as its gather units (a repeated class)
    sub = type(cls.__name__, (cls,), {"__call__": lambda self, x: checkpoint(functools.partial(nn.Module.__call__, self),
                                                                            x)})
    for block in model.blocks:
        block.__class__ = sub


def build(args, world: int, cfg: dict, mcfg: GPTConfig):
    torch.manual_seed(args.seed)
    init_kw = {"remote_device": "nvme", "config_dict_or_path": cfg} if args.mode == "nvme" and args.init_nvme else {}
    if args.system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # else Init's config sees world size 1
        if args.model in GPT_SIZES:
            model = GPT(mcfg)
            if args.mode == "nvme":  # DeepSpeed's own Init of an fp32 model with params on NVMe picks bf16
                deepspeed.zero.Init(module=model, config_dict_or_path=cfg)  # on this CPU accelerator: convert here
            return model
        with deepspeed.zero.Init(**{"config_dict_or_path": cfg, **init_kw}):
            return InitGPT(mcfg)
    if args.model in GPT_SIZES:
        return GPT(mcfg)
    import zerospeed

    with zerospeed.zero.Init(**init_kw):
        return InitGPT(mcfg)


def run(args, rank: int, world: int, busy: _Busy) -> dict:
    phases = _Phases()
    rss_start = peak_rss_bytes()
    batches = torch.load(args.data, weights_only=True)
    total = args.warmup + args.steps
    mine = batches[rank, :total, :args.micro_batch].long().clone()
    del batches
    mcfg = model_config(args.model, mine.shape[-1] - 1)
    d = mcfg.d_model  # DeepSpeed: >= the largest parameter; zerospeed: >= a block's shard per rank
    largest = max(4 * d * d, mcfg.vocab_size * d, (12 * d * d + 16 * d) // world + 4096)
    precision = split_model(args.model)[1]
    cfg = offload_config(system=args.system, mode=args.mode, micro=args.micro_batch, world=world,
                         nvme_path=args.nvme_path, buffer_size=largest, precision=precision,
                         param_buffers=args.param_buffers, pipeline=args.pipeline, aio_threads=args.aio_threads,
                         super_offload="super" in variants(args.model))
    if "nourgent" in variants(args.model):
        _no_urgent_reads()
    if "nodefer" in variants(args.model):
        import zerospeed.zero.stage3 as stage3
        stage3.FORWARD_SHARE = 0.0
    for v in variants(args.model):  # '+pendingN' / '+setsN': super_offload's BackwardSteps(max_pending=, sets=)
        for prefix, name in (("pending", "BACKWARD_PENDING"), ("sets", "BACKWARD_SETS")):
            if v.startswith(prefix) and v[len(prefix):].isdigit():
                import zerospeed.offload.budget as budget
                import zerospeed.zero.stage3 as stage3
                setattr(stage3, name, int(v[len(prefix):]))
                setattr(budget, name, int(v[len(prefix):]))  # the pre-flight budget counts them
    phases.phase = "build"
    model = build(args, world, cfg, mcfg)
    if args.ckpt:
        checkpoint_blocks(model, args.system)
    phases.phase = "initialize"
    n_params = mcfg.num_params()
    t0 = time.perf_counter()
    runner = _EngineRunner()
    if args.system == "deepspeed":
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        runner.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        import zerospeed

        runner.engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    setup_s = time.perf_counter() - t0
    phases.phase = "train"
    offload = getattr(runner.engine, "offload", None) if args.system == "zerospeed" else None
    aio = offload.aio if offload is not None else None
    budget = getattr(offload, "budget", None)
    step_s, cpu_s, losses, fb_s = [], [], [], []
    io0 = None
    split = [0.0] * 12  # forward, backward, step: wall, CPU, disk busy, training thread's I/O wait (s, timed steps)

    def snap():
        return time.perf_counter(), time.process_time(), busy.busy_now(), busy.wait_s

    def counters():
        return (*proc_io(), busy.seconds, busy.read_s, busy.write_s, busy.wait_s,
                *((aio.bytes_read, aio.bytes_written, aio.read_seconds, aio.write_seconds) if aio else (0, 0, 0, 0)))
    for i in range(total):
        if i == args.warmup:
            io0 = counters()
        x, y = mine[i, :, :-1], mine[i, :, 1:]
        t, c = time.perf_counter(), time.process_time()
        s0 = snap()
        loss = runner.engine(x, y)
        s1 = snap()
        runner.engine.backward(loss)
        s2 = snap()
        fb_s.append(time.perf_counter() - t)
        runner.step()
        s3 = snap()
        step_s.append(time.perf_counter() - t)
        cpu_s.append(time.process_time() - c)
        if i >= args.warmup:
            for j, (a, b) in enumerate(((s0, s1), (s1, s2), (s2, s3))):
                for k in range(4):
                    split[4 * j + k] += (b[k] - a[k]) / args.steps
        losses.append(float(loss.detach().float()))
        print(f"rank {rank} step {i}: {step_s[-1]:.2f} s loss {losses[-1]:.4f}", flush=True)
    io1 = counters()
    peaks = phases.stop()
    io = [b - a for a, b in zip(io0, io1)]
    disk = offload.disk_bytes() if offload is not None else 0
    times, cpus, loss_ranks = all_gather_floats(step_s), all_gather_floats(cpu_s), all_gather_floats(losses)
    fbs, splits = all_gather_floats(fb_s), all_gather_floats(split)
    names = ("build", "initialize", "train")
    per_rank = all_gather_floats([peak_rss_bytes(), rss_start, setup_s, disk, *io,
                                  *(float(peaks.get(n, 0)) for n in names)])
    nio = len(io)
    if hasattr(runner.engine, "destroy"):
        runner.engine.destroy()
    keys = ["disk_read", "disk_written", "aio_busy_s", "aio_busy_read_s", "aio_busy_write_s", "aio_wait_s", "aio_read",
            "aio_written", "aio_read_s", "aio_write_s"]
    return {"status": "ok", "n_params": n_params, "d_model": mcfg.d_model, "n_layer": mcfg.n_layer,
            "step_s": [max(r[i] for r in times) for i in range(total)],
            "cpu_s": [max(r[i] for r in cpus) for i in range(total)],
            "forward_backward_s": [max(r[i] for r in fbs) for i in range(total)],
            "losses": [sum(r[i] for r in loss_ranks) / world for i in range(total)],
            "peak_rss_bytes": [r[0] for r in per_rank], "start_rss_bytes": [r[1] for r in per_rank],
            "setup_s": max(r[2] for r in per_rank), "swap_bytes": [r[3] for r in per_rank],
            "io": [dict(zip(keys, r[4:4 + nio])) for r in per_rank], "has_aio_counters": aio is not None,
            "phase_rss_bytes": [dict(zip(names, r[4 + nio:])) for r in per_rank], "precision": precision,
            "predicted_host_bytes": budget.host_total if budget else None,
            "predicted_disk_bytes": budget.disk_total if budget else None,
            "predicted_host": dict(budget.host) if budget else None,
            "ckpt": args.ckpt,
            # per rank: {phase: [wall, CPU, disk busy, I/O wait]}, seconds per timed step
            "phase_split_s": [{ph: r[4 * j:4 * j + 4] for j, ph in enumerate(("forward", "backward", "step"))}
                              for r in splits]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["zerospeed", "deepspeed"], required=True)
    p.add_argument("--mode", choices=["mem", "cpu", "nvme"], required=True)
    p.add_argument("--model", default="base", help="base | big:LAYERSxWIDTH")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--param-buffers", type=int, default=16, help="offload_param.buffer_count")
    p.add_argument("--pipeline", action="store_true", help="offload_optimizer.pipeline_read/write")
    p.add_argument("--aio-threads", type=int, default=1, help="aio.thread_count (I/O threads per rank)")
    p.add_argument("--init-nvme", action="store_true", help='NVMe mode: Init(remote_device="nvme")')
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
    busy = _Busy()
    if args.system == "zerospeed":
        busy.install()
    meta = {"system": args.system, "mode": args.mode, "model": args.model, "world_size": world,
            "steps": args.steps, "warmup": args.warmup, "micro_batch": args.micro_batch}
    try:
        result, code = run(args, rank, world, busy), 0
    except Exception as e:  # noqa: BLE001 - reported in the table, the benchmark goes on
        result = {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(result["traceback"], file=sys.stderr, flush=True)
        code = 1
    return publish(args.result, rank, meta, result, code)


if __name__ == "__main__":
    sys.exit(main())
