"""`zerospeed estimate`: model-state memory per rank for ZeRO stages 0-3 (`zero/memory.py`).

    $ zerospeed estimate --params 7.5e9 --dp 64
    Model states per rank, Ψ = 7.50e+09 parameters, N = 64 data-parallel ranks, mixed precision, Adam
    (GB = 1e9 bytes; ZeRO, Rajbhandari et al. 2020, §5)
    stage   params    grads  optimizer   master    total
        0    15.00    15.00      60.00    30.00   120.00
        ...

    $ zerospeed estimate --params 7B --world 64 --tp 4 --pp 2 --replicated-params 0.26B
    (Ψ per rank before ZeRO = (Ψ_s / tp + Ψ_r) / pp, balanced stages; ZeRO over N = 64 / (4 x 2) = 8)

    $ zerospeed estimate --offload nvme --hidden 2560 --dp 2 --precision mixed --nvme-path /nvme
    ZeRO-Infinity (stage 3, optimizer, gradients and parameters on NVMe): the largest model this node
    trains, given its RAM and the free disk at --nvme-path (`offload.budget`), and the per-rank budget.
"""
from __future__ import annotations

import argparse
import math
import re

from ..config.zero import DEFAULT_REDUCE_BUCKET_SIZE
from ..offload.budget import largest_model, rank_budget
from ..offload.policy import OffloadPolicy
from .memory import (BYTES_PER_PARAM, PARTITIONED, data_parallel_size, estimate_model_states_memory,
                     model_parallel_params)

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'7.5e9', '7.5B', '350M', '1.3b' -> a parameter count. Raises argparse.ArgumentTypeError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (examples: 7.5e9, 7.5B, 350M)")
    return float(m.group(1)) * _SUFFIX[m.group(2).lower()]


def format_table(num_params: float, stages: list[int], dp_world_size: int, precision: str, *, tp: int = 1,
                 pp: int = 1, replicated_params: float | None = None) -> str:
    """The table `main` prints: one row per stage, columns in GB (1e9 bytes). With tp or pp > 1, ZeRO
    partitions the model-parallel share Ψ_rank = (Ψ_s / tp + Ψ_r) / pp (`memory.model_parallel_params`;
    replicated_params None: taken as 0, and the header says so)."""
    local = num_params
    lines = [f"Model states per rank, Ψ = {num_params:.2e} parameters, N = {dp_world_size} data-parallel ranks, "
             f"{precision} precision, Adam"]
    if tp > 1 or pp > 1:
        local = model_parallel_params(num_params, tp=tp, pp=pp, replicated_params=replicated_params or 0)
        world = dp_world_size * tp * pp
        lines += [f"tensor parallel tp = {tp}, pipeline parallel pp = {pp}, world = {tp} x {pp} x {dp_world_size} = "
                  f"{world}: Ψ per rank before ZeRO = (Ψ_s / tp + Ψ_r) / pp = {local:.2e}",
                  "(balanced pipeline stages: each holds 1/pp of the parameters; Ψ_r = " + (
                      f"{replicated_params:.2e} replicated parameters (embeddings, norms) kept whole on every "
                      "tensor-parallel rank)" if replicated_params is not None else
                      "0: every parameter in a tensor-parallel layer, as Megatron's vocab-parallel embeddings; "
                      "zerospeed replicates embeddings and norms: pass --replicated-params, e.g. the replicated "
                      "count `zerospeed tp-plan` prints)")]
    lines += ["(GB = 1e9 bytes; ZeRO, Rajbhandari et al. 2020, §5)",
              f"{'stage':>5}{'params':>9}{'grads':>9}{'optimizer':>11}{'master':>9}{'total':>9}"]
    for stage in stages:
        m = estimate_model_states_memory(math.ceil(local), stage, dp_world_size, precision)
        gb = {k: v / 1e9 for k, v in m.items()}
        lines.append(f"{stage:>5}{gb['params']:>9.2f}{gb['grads']:>9.2f}{gb['optimizer_states']:>11.2f}"
                     f"{gb['master_weights']:>9.2f}{gb['total']:>9.2f}")
    return "\n".join(lines)


def format_offload(args) -> str:
    """`--offload nvme`: the largest Ψ this node trains with both tiers on NVMe (or, with --params, the
    budget of that Ψ and whether it fits), for blocks of width --hidden (a unit of 12 x hidden² elements)."""
    import os
    import shutil

    ram = args.ram if args.ram is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    disk = args.disk if args.disk is not None else shutil.disk_usage(args.nvme_path).free
    unit = int(args.largest_unit or 12 * args.hidden ** 2)
    mixed = args.precision == "mixed"
    pol = OffloadPolicy(optimizer="nvme", param="nvme", sub_group_size=int(args.sub_group_size), pipeline=args.pipeline,
                        param_buffer_count=args.buffer_count, max_in_cpu=0, super_offload=args.super_offload)
    dp, process = args.dp or 1, int(args.process_bytes)

    def budget_of(n):
        return rank_budget(pol, numel=max(int(n), 1), largest_unit=unit, world=dp, param_bytes=2 if mixed else 4,
                           mixed=mixed, grad_accum=args.grad_accum, prefetch_bucket_size=unit,
                           reduce_bucket_size=DEFAULT_REDUCE_BUCKET_SIZE)
    psi, limit = largest_model(ram_bytes=int(ram), disk_bytes=int(disk), ranks=dp, process_bytes=process,
                               budget_of=budget_of)
    shown = int(args.params) if args.params else psi
    b = budget_of(shown)
    gb = 1e9
    lines = [f"ZeRO-Infinity, stage 3, optimizer + gradients + parameters on NVMe, {args.precision} precision, "
             f"Adam; {dp} ranks on this node, gather unit {unit:.3g} elements (12 x hidden²)",
             f"node: RAM {ram / gb:.1f} GB, free disk {disk / gb:.1f} GB; per rank {process / gb:.2f} GB for the "
             "process itself (torch, process group), activations not counted (use activation checkpointing)",
             f"per-rank host budget at Ψ = {shown:.3g} (GB): " + ", ".join(
                 f"{k} {v / gb:.2f}" for k, v in b.host.items()) + f"; total {b.host_total / gb:.2f}",
             f"per-rank disk at Ψ = {shown:.3g} (GB): " + ", ".join(f"{k} {v / gb:.2f}" for k, v in b.disk.items())
             + f"; node total {dp * b.disk_total / gb:.1f}"]
    if args.params:
        fits = dp * (b.host_total + process) <= ram and dp * b.disk_total <= disk
        lines.append(f"Ψ = {shown:.3g}: {'fits' if fits else 'does not fit'} (largest: {psi:.3g}, limited by {limit})")
    else:
        lines.append(f"largest trainable: Ψ = {psi / 1e9:.2f}B parameters, limited by {limit}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `zerospeed estimate`; returns the exit code (argparse exits 2 on bad arguments)."""
    parser = argparse.ArgumentParser(prog="zerospeed estimate",
                                     description="Model-state memory per rank (bytes of parameters, gradients, "
                                                 "optimizer states, master weights) under ZeRO stages 0-3.")
    parser.add_argument("--params", type=parse_count, default=None, help="trainable parameters, e.g. 7.5e9 or 7.5B")
    off = parser.add_argument_group("ZeRO-Infinity (--offload nvme): the largest model this node trains")
    off.add_argument("--offload", choices=["nvme"], default=None,
                     help="stage 3 with offload_optimizer and offload_param on NVMe")
    off.add_argument("--hidden", type=int, default=None, help="hidden size: a block of 12 x hidden² elements")
    off.add_argument("--largest-unit", type=parse_count, default=None, help="elements of the largest block instead")
    off.add_argument("--nvme-path", default=".", help="where the swap files go (its free disk is used)")
    off.add_argument("--ram", type=parse_count, default=None, help="node RAM in bytes (default: this machine's)")
    off.add_argument("--disk", type=parse_count, default=None, help="free disk in bytes (default: at --nvme-path)")
    off.add_argument("--buffer-count", type=int, default=5, help="offload_param.buffer_count (default 5)")
    off.add_argument("--sub-group-size", type=parse_count, default=1e9, help="sub_group_size (default 1e9)")
    off.add_argument("--pipeline", action="store_true", help="offload_optimizer.pipeline_read/write")
    off.add_argument("--super-offload", action="store_true",
                     help="offload_optimizer.super_offload (the step during the backward: its buffers)")
    off.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps (default 1)")
    off.add_argument("--process-bytes", type=parse_count, default=400e6,
                     help="bytes each rank's process takes besides model states (default 400M, measured here)")
    parser.add_argument("--stage", type=int, choices=sorted(PARTITIONED), default=None,
                        help="one ZeRO stage (default: all of 0-3)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel ranks N (default: --world / (tp x pp), or 1)")
    parser.add_argument("--world", type=int, default=None, help="all ranks; N = world / (tp x pp)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages, assumed balanced (default 1)")
    parser.add_argument("--replicated-params", type=parse_count, default=None,
                        help="parameters outside tensor-parallel layers, kept whole on every tensor-parallel rank "
                             "(embeddings, norms; default 0); `zerospeed tp-plan` prints the count for a HF model")
    parser.add_argument("--precision", choices=sorted(BYTES_PER_PARAM), default="mixed",
                        help="mixed: fp16/bf16 with fp32 master weights (default); fp32: fp32 training")
    args = parser.parse_args(argv)
    if args.offload:
        if args.hidden is None and args.largest_unit is None:
            parser.error("--offload nvme needs --hidden (or --largest-unit): what stays in memory is set by the "
                         "largest block, not by the number of parameters")
        if args.precision not in ("mixed", "fp32"):
            parser.error(f"--precision {args.precision}: use mixed or fp32")
        print(format_offload(args))
        return 0
    if args.params is None:
        parser.error("--params is required (or --offload nvme --hidden H for the largest model)")
    for flag in ("dp", "world", "tp", "pp"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    dp = args.dp
    if args.world is not None:
        try:
            from_world = data_parallel_size(args.world, args.tp, args.pp)
        except ValueError as exc:
            parser.error(f"--world {args.world}: {exc}")
        if dp is not None and dp != from_world:
            parser.error(f"--dp {dp} x --tp {args.tp} x --pp {args.pp} != --world {args.world}; give one of --dp and "
                         f"--world (here --dp {from_world})")
        dp = from_world
    if args.replicated_params is not None and not 0 <= args.replicated_params <= args.params:
        parser.error(f"--replicated-params {args.replicated_params:g} must lie in [0, --params {args.params:g}]")
    stages = [args.stage] if args.stage is not None else sorted(PARTITIONED)
    print(format_table(args.params, stages, dp or 1, args.precision, tp=args.tp, pp=args.pp,
                       replicated_params=args.replicated_params))
    return 0
