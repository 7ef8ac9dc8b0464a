"""`zerospeed` command line: each subcommand lives in its own module and is imported lazily."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help); each module exposes main(argv: list[str]) -> int | None
COMMANDS = {
    "launch": ("zerospeed.launcher.launch", "run a training script on N local ranks / nodes (torchrun underneath)"),
    "demo": ("zerospeed.demo.cli", "train a byte-level GPT on Python's standard library source"),
    "to-fp32": ("zerospeed.runtime.consolidate", "consolidate a checkpoint into fp32 safetensors (offline, streaming)"),
    "estimate": ("zerospeed.zero.estimate_cli", "model-state memory per rank for ZeRO stages 0-3 (--params 7.5e9 --dp 64 [--tp 2 --pp 2]); the largest model with NVMe offload (--offload nvme --hidden 4096)"),
    "tp-plan": ("zerospeed.tensor_parallel.plan_cli", "the tensor-parallel sharding plan of a HF model (--model-type llama --tp 2)"),
    "pipe-schedule": ("zerospeed.pipe.schedule_cli", "the fastest pipeline schedule for measured per-stage times (--stages 4 --microbatches 8 --forward 0.01 ...)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
        msg = "usage: zerospeed COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"zerospeed: unknown command {argv[0]!r}\n\n{msg}", file=sys.stderr)
            return 2
        print(msg)
        return 0
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
