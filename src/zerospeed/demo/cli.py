"""`zerospeed demo`: the demo training run on N local ranks (default 2), via `zerospeed launch`.

Options not listed here are passed to the rank script (`python -m zerospeed.demo.train --help`).
"""
from __future__ import annotations

import argparse
import os


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="zerospeed demo", description=__doc__)
    p.add_argument("--nproc-per-node", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--threads-per-rank", type=int, default=1, help="OMP_NUM_THREADS per rank (default 1)")
    args, rest = p.parse_known_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads_per_rank))
    from zerospeed.launcher.launch import main as launch

    return launch(["--nproc-per-node", str(args.nproc_per_node), "-m", "zerospeed.demo.train", *rest])
