"""`zerospeed estimate`: model-state memory per rank for ZeRO stages 0-3 (`zero/memory.py`).

    $ zerospeed estimate --params 7.5e9 --dp 64
    Model states per rank, Ψ = 7.50e+09 parameters, N = 64 data-parallel ranks, mixed precision, Adam
    (GB = 1e9 bytes; ZeRO, Rajbhandari et al. 2020, §5)
    stage   params    grads  optimizer   master    total
        0    15.00    15.00      60.00    30.00   120.00
        ...
"""
from __future__ import annotations

import argparse
import re

from .memory import BYTES_PER_PARAM, PARTITIONED, estimate_model_states_memory

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'7.5e9', '7.5B', '350M', '1.3b' -> a parameter count. Raises argparse.ArgumentTypeError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (examples: 7.5e9, 7.5B, 350M)")
    return float(m.group(1)) * _SUFFIX[m.group(2).lower()]


def format_table(num_params: float, stages: list[int], dp_world_size: int, precision: str) -> str:
    """The table `main` prints: one row per stage, columns in GB (1e9 bytes)."""
    lines = [f"Model states per rank, Ψ = {num_params:.2e} parameters, N = {dp_world_size} data-parallel ranks, "
             f"{precision} precision, Adam",
             "(GB = 1e9 bytes; ZeRO, Rajbhandari et al. 2020, §5)",
             f"{'stage':>5}{'params':>9}{'grads':>9}{'optimizer':>11}{'master':>9}{'total':>9}"]
    for stage in stages:
        m = estimate_model_states_memory(num_params, stage, dp_world_size, precision)
        gb = {k: v / 1e9 for k, v in m.items()}
        lines.append(f"{stage:>5}{gb['params']:>9.2f}{gb['grads']:>9.2f}{gb['optimizer_states']:>11.2f}"
                     f"{gb['master_weights']:>9.2f}{gb['total']:>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `zerospeed estimate`; returns the exit code (argparse exits 2 on bad arguments)."""
    parser = argparse.ArgumentParser(prog="zerospeed estimate",
                                     description="Model-state memory per rank (bytes of parameters, gradients, "
                                                 "optimizer states, master weights) under ZeRO stages 0-3.")
    parser.add_argument("--params", type=parse_count, required=True, help="trainable parameters, e.g. 7.5e9 or 7.5B")
    parser.add_argument("--stage", type=int, choices=sorted(PARTITIONED), default=None,
                        help="one ZeRO stage (default: all of 0-3)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks N (default 1)")
    parser.add_argument("--precision", choices=sorted(BYTES_PER_PARAM), default="mixed",
                        help="mixed: fp16/bf16 with fp32 master weights (default); fp32: fp32 training")
    args = parser.parse_args(argv)
    if args.dp < 1:
        parser.error(f"--dp must be >= 1, got {args.dp}")
    stages = [args.stage] if args.stage is not None else sorted(PARTITIONED)
    print(format_table(args.params, stages, args.dp, args.precision))
    return 0
