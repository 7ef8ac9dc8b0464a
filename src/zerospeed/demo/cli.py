"""`zerospeed demo`: the demo training run on N local ranks (default 2), via `zerospeed launch`.

Options not listed here are passed to the rank script (`python -m zerospeed.demo.train --help`).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

#: The demo's ds_config, shipped inside the package (package data), so `zerospeed demo` works from any
#: directory after a plain `pip install`.
DEFAULT_CONFIG = Path(__file__).resolve().with_name("demo.json")


def find_config(path: str | Path) -> Path | None:
    """`path` resolved, or None if it is not a file."""
    p = Path(path)
    return p.resolve() if p.is_file() else None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="zerospeed demo", description=__doc__)
    p.add_argument("--nproc-per-node", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--threads-per-rank", type=int, default=1, help="OMP_NUM_THREADS per rank (default 1)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="ds_config JSON (default: the demo.json shipped in zerospeed/demo/)")
    args, rest = p.parse_known_args(argv)
    config = find_config(args.config)
    if config is None:  # fail here, once, before any rank starts
        print(f"zerospeed demo: config file {args.config!r} not found; pass --config PATH", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads_per_rank))
    from zerospeed.launcher.launch import main as launch

    return launch(["--nproc-per-node", str(args.nproc_per_node), "-m", "zerospeed.demo.train",
                   "--config", str(config), *rest])
