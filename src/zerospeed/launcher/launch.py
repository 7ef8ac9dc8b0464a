"""``zerospeed launch``: a thin, DeepSpeed-flavoured front end over ``torch.distributed.run`` (torchrun).

We translate our options (plus DeepSpeed's underscore spellings) into a torchrun argument list and
call torchrun in-process, so torchrun's elastic agent does all process management. We never ssh:
with a multi-node hostfile we print the torchrun / srun command to run on each node instead.

Failures: each rank runs the script through ``zerospeed.launcher.record`` (torchelastic's ``@record``
for an undecorated script), which writes an uncaught exception to the rank's
``TORCHELASTIC_ERROR_FILE`` instead of printing it. torchrun's agent reads those files into its
``ChildFailedError``, and ``main`` prints one summary: the first failing rank's traceback once,
then one ``[rank 0, 1] ValueError: ...`` line per distinct error. Failures without a recorded
exception (``os._exit``, signals) keep torchrun's own failure table.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass

from zerospeed.launcher.hostfile import parse_hostfile

__all__ = ["DEFAULT_MASTER_PORT", "LaunchPlan", "build_torchrun_args", "default_nproc_per_node",
           "format_failures", "get_parser", "main", "node_commands", "parse_args", "resolve_plan"]

DEFAULT_MASTER_PORT = 29500
_JOB_ID = "$SLURM_JOB_ID"  # left for the shell to expand in the printed srun command
_RECORD_MODULE = "zerospeed.launcher.record"


def get_parser() -> argparse.ArgumentParser:
    """The ``zerospeed launch`` argument parser (torchrun spellings first, DeepSpeed's as aliases)."""
    p = argparse.ArgumentParser(
        prog="zerospeed launch", allow_abbrev=False,
        description="Run SCRIPT on N local processes per node via torch.distributed.run (torchrun).")
    p.add_argument("--nnodes", "--num_nodes", "--num-nodes", dest="nnodes", type=int, default=None,
                   help="number of nodes (default: hosts in --hostfile, else 1)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", "--num_gpus", "--num-gpus", "--num_accelerators",
                   dest="nproc_per_node", type=int, default=None,
                   help="processes per node (default: hostfile slots, else accelerator count, else 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
                   help="rank of this node in [0, nnodes) (multi-node only)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help="address of node 0 (default: first hostfile host, else 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help=f"port on node 0 (default {DEFAULT_MASTER_PORT}; on one node without it a free "
                        "port is picked via torchrun --standalone)")
    p.add_argument("-H", "--hostfile", dest="hostfile", default=None,
                   help="DeepSpeed hostfile: one 'hostname slots=N' line per node")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                   help="restarts of the whole worker group after a failure (default 0)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", choices=("static", "c10d"),
                   default=None, help="torchrun rendezvous backend (default: static, or --standalone)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default=None,
                   help="HOST:PORT for --rdzv-backend c10d (default MASTER_ADDR:MASTER_PORT)")
    p.add_argument("-m", "--module", dest="module", action="store_true",
                   help="treat SCRIPT as a module name and run it like 'python -m'")
    p.add_argument("script", help="training script path (or module name with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``zerospeed launch`` arguments (without the ``launch`` word). Exits (SystemExit) on bad usage."""
    return get_parser().parse_args(argv)


def default_nproc_per_node() -> int:
    """Processes per node when none is given: the accelerator device count, or 1 on a CPU-only machine."""
    import torch

    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accel is not None and accel.is_available():
        return max(1, int(accel.device_count()))
    return 1


@dataclass(frozen=True)
class LaunchPlan:
    """Resolved launch geometry: what torchrun will be told, before any process exists."""

    nnodes: int
    nproc_per_node: int
    node_rank: int | None      # None: not given (single node, or print one command per node)
    master_addr: str
    master_port: int | None    # None: not given
    hosts: tuple[str, ...]     # hostfile hosts in use (first nnodes), empty without a hostfile
    standalone: bool           # one node, no port, no rendezvous backend: torchrun --standalone


def resolve_plan(ns: argparse.Namespace) -> LaunchPlan:
    """Resolve defaults and the hostfile into a :class:`LaunchPlan`.

    Args:
        ns: the namespace from :func:`parse_args`.

    Raises:
        FileNotFoundError: ``--hostfile`` names a missing file.
        ValueError: malformed hostfile; ``--nnodes`` larger than the hostfile's host count; unequal
            slots without ``--nproc-per-node`` (torchrun starts the same count on every node);
            ``--nproc-per-node`` above a host's slots; counts < 1; ``--node-rank`` outside
            ``[0, nnodes)``; a bad port; or a multi-node launch without a hostfile that lacks
            ``--master-addr`` / ``--node-rank``.
    """
    hosts: tuple[str, ...] = ()
    if ns.hostfile:
        pool = parse_hostfile(ns.hostfile)
        if ns.nnodes is not None and ns.nnodes > len(pool):
            raise ValueError(f"--nnodes {ns.nnodes} but hostfile {ns.hostfile!r} lists only {len(pool)} "
                             f"host(s): {', '.join(pool)}")
        hosts = tuple(pool)[: ns.nnodes or len(pool)]
        slots = {h: pool[h] for h in hosts}
        nnodes = len(hosts)
        if ns.nproc_per_node is None:
            if len(set(slots.values())) > 1:
                listing = ", ".join(f"{h} slots={n}" for h, n in slots.items())
                raise ValueError(
                    f"hostfile {ns.hostfile!r} has unequal slots ({listing}); torchrun starts the same "
                    f"number of processes on every node: make the slots equal or pass --nproc-per-node K "
                    f"with K <= {min(slots.values())}")
            nproc = next(iter(slots.values()))
        else:
            nproc = ns.nproc_per_node
            short = {h: n for h, n in slots.items() if n < nproc}
            if short:
                raise ValueError(f"--nproc-per-node {nproc} exceeds the slots of "
                                 + ", ".join(f"{h} (slots={n})" for h, n in short.items())
                                 + f" in hostfile {ns.hostfile!r}")
        master_addr = ns.master_addr or hosts[0]
    else:
        nnodes = 1 if ns.nnodes is None else ns.nnodes
        nproc = default_nproc_per_node() if ns.nproc_per_node is None else ns.nproc_per_node
        master_addr = ns.master_addr or "127.0.0.1"
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc}")
    if ns.node_rank is not None and not 0 <= ns.node_rank < nnodes:
        raise ValueError(f"--node-rank {ns.node_rank} is outside [0, {nnodes}) for {nnodes} node(s)")
    if ns.master_port is not None and not 1 <= ns.master_port <= 65535:
        raise ValueError(f"--master-port must be in 1..65535, got {ns.master_port}")
    if ns.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {ns.max_restarts}")
    if nnodes > 1 and not hosts:
        if ns.master_addr is None and ns.rdzv_endpoint is None:
            raise ValueError(f"--nnodes {nnodes} needs --master-addr (the address of node 0, reachable from "
                             f"every node) or a --hostfile")
        if ns.node_rank is None and ns.rdzv_backend != "c10d":
            raise ValueError(f"--nnodes {nnodes} needs --node-rank R on each node (0 on the master node), "
                             f"or --rdzv-backend c10d which assigns node ranks itself")
    standalone = nnodes == 1 and ns.master_port is None and ns.rdzv_backend is None
    return LaunchPlan(nnodes=nnodes, nproc_per_node=nproc, node_rank=ns.node_rank, master_addr=master_addr,
                      master_port=ns.master_port, hosts=hosts, standalone=standalone)


def build_torchrun_args(ns: argparse.Namespace, *, node_rank: int | None = None,
                        record: bool = False) -> list[str]:
    """Translate parsed ``zerospeed launch`` options into ``torch.distributed.run`` arguments.

    Args:
        ns: the namespace from :func:`parse_args`.
        node_rank: overrides ``ns.node_rank`` (used to print one command per hostfile node).
        record: run the script through ``python -m zerospeed.launcher.record`` so an uncaught
            exception reaches the launcher through torchelastic's error file (what ``main`` does;
            the commands printed for other nodes run the script directly).

    Returns:
        The argument list for ``torchrun`` / ``torch.distributed.run.main``, ending in the script
        (or module) and its arguments. One node without ``--master-port`` gives ``--standalone``
        (free port, local rendezvous); otherwise static rendezvous with ``--node-rank``,
        ``--master-addr``, ``--master-port``, or c10d rendezvous with ``--rdzv-endpoint``.

    Raises:
        FileNotFoundError, ValueError: as :func:`resolve_plan`.
    """
    if node_rank is not None:
        ns = argparse.Namespace(**{**vars(ns), "node_rank": node_rank})
    plan = resolve_plan(ns)
    args = ["--standalone"] if plan.standalone else []
    args += ["--nnodes", str(plan.nnodes), "--nproc-per-node", str(plan.nproc_per_node)]
    if not plan.standalone:
        port = DEFAULT_MASTER_PORT if plan.master_port is None else plan.master_port
        if ns.rdzv_backend == "c10d":
            args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", ns.rdzv_endpoint or f"{plan.master_addr}:{port}"]
        else:
            args += ["--node-rank", str(plan.node_rank or 0), "--master-addr", plan.master_addr,
                     "--master-port", str(port)]
    args += ["--max-restarts", str(ns.max_restarts)]
    if record:
        return args + ["--module", _RECORD_MODULE, *(["--module"] if ns.module else []), ns.script, *ns.script_args]
    if ns.module:
        args.append("--module")
    return args + [ns.script, *ns.script_args]


def node_commands(ns: argparse.Namespace) -> str:
    """Text telling the user what to run on each hostfile node (we do not ssh), plus a SLURM variant.

    Raises:
        FileNotFoundError, ValueError: as :func:`resolve_plan`.
    """
    plan = resolve_plan(ns)
    lines = [f"zerospeed launch: hostfile {ns.hostfile!r} describes {plan.nnodes} nodes x "
             f"{plan.nproc_per_node} processes; zerospeed does not ssh. Run on each node:"]
    for rank, host in enumerate(plan.hosts):
        lines.append(f"  [{host}]  torchrun {shlex.join(build_torchrun_args(ns, node_rank=rank))}")
    c10d = argparse.Namespace(**{**vars(ns), "rdzv_backend": "c10d", "node_rank": None})
    srun = ["srun", f"--nodes={plan.nnodes}", "--ntasks-per-node=1", f"--nodelist={','.join(plan.hosts)}",
            "torchrun", "--rdzv-id", _JOB_ID, *build_torchrun_args(c10d)]
    lines += ["(or 'zerospeed launch --hostfile ... --node-rank R ...' on node R), or under SLURM, one task "
              "per node:", "  " + shlex.join(srun).replace(shlex.quote(_JOB_ID), '"$SLURM_JOB_ID"')]
    return "\n".join(lines)


def _failure_line(failure) -> tuple[str, bool]:
    """(one-line description of a torchelastic ProcessFailure, whether it carries a Python exception)."""
    message = failure.message
    if isinstance(message, dict) and isinstance(message.get("message"), str):
        return message["message"], True
    if failure.exitcode < 0:
        return f"stopped by signal {failure.signal_name()}", False
    return f"exited with code {failure.exitcode} (no Python exception recorded)", False


def _without_final_message(callstack: str, message: str) -> str:
    """The traceback without its last ``Type: message`` lines when they repeat ``message`` (which the
    rank-tagged line prints), so the error appears once. Unchanged when the ending differs."""
    stack = callstack.rstrip()
    name, _, rest = message.partition(": ")
    tail = f"{name}: {rest}" if rest else name
    idx = stack.rfind(tail)
    if idx < 0 or idx + len(tail) != len(stack):
        return stack
    start = stack.rfind("\n", 0, idx) + 1
    prefix = stack[start:idx]  # "" or the module of a non-builtin exception ("pkg.errors.")
    if prefix and not (prefix.endswith(".") and prefix[:-1].replace(".", "").replace("_", "").isalnum()):
        return stack
    return stack[:start].rstrip()


def _rank_tag(ranks: list[int]) -> str:
    return f"[rank {', '.join(map(str, sorted(ranks)))}]"


def format_failures(exc, world_size: int | None = None) -> str | None:
    """One summary for a torchrun ``ChildFailedError``, or None when no rank recorded an exception.

    The first failing rank's traceback (from its error file, without the final exception line)
    comes once, then one rank-tagged line per distinct error, the first failure's first:
    ``[rank 0, 1] ValueError: bad lr``.
    """
    described = {rank: _failure_line(f) for rank, f in exc.failures.items()}
    recorded = [rank for rank, (_, has_exc) in described.items() if has_exc]
    if not recorded:
        return None
    first, _ = exc.get_first_failure()
    if first not in recorded:  # e.g. a rank stopped by a signal in the same second
        first = min(recorded, key=lambda r: (exc.failures[r].timestamp, r))
    groups: dict[str, list[int]] = {}
    for rank in [first, *sorted(r for r in described if r != first)]:
        groups.setdefault(described[rank][0], []).append(rank)
    root = exc.failures[first].message
    callstack = _without_final_message(root.get("extraInfo", {}).get("py_callstack", ""), root["message"])
    of = f" of {world_size}" if world_size else ""
    noun = "rank" if (world_size or len(described)) == 1 else "ranks"
    lines = [f"zerospeed launch: rank {first} failed first; its traceback:", callstack.rstrip(), "",
             f"zerospeed launch: {len(described)}{of} {noun} failed:"]
    lines += [f"{_rank_tag(ranks)} {text}" for text, ranks in groups.items()]
    return "\n".join(lines)


class _DropWorkerFailedLog:
    """logging filter for torchrun's lines that the summary repeats: 'failed (exitcode: ...)' per
    failed rank, and 'Sending process ... closing signal' for the ranks it stops afterwards."""

    @staticmethod
    def filter(record) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("failed (exitcode")
                    or (msg.startswith("Sending process") and "closing signal" in msg))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zerospeed launch``; returns the process exit code.

    Args:
        argv: arguments after ``launch`` (default ``sys.argv[1:]``).

    Returns:
        0 on success (or after printing per-node commands for a multi-node hostfile without
        ``--node-rank``), 1 if any rank failed (one rank-tagged summary goes to stderr, see
        :func:`format_failures`), 2 on a usage or configuration error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ns = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        plan = resolve_plan(ns)
        if plan.nnodes > 1 and plan.hosts and ns.node_rank is None:
            print(node_commands(ns))
            return 0
        if not ns.module and not os.path.isfile(ns.script):
            raise FileNotFoundError(f"training script {ns.script!r} not found (use -m/--module for a module)")
        args = build_torchrun_args(ns, record=True)
    except (FileNotFoundError, ValueError) as exc:
        print(f"zerospeed launch: error: {exc}", file=sys.stderr)
        return 2

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    import logging

    api_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    api_log.addFilter(_DropWorkerFailedLog)
    try:
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # we are a worker of an outer agent: @record it
            torchrun.main(args)
        else:  # torchrun.main's @record would only log that the launcher has no error file of its own
            torchrun.run(torchrun.parse_args(args))
    except ChildFailedError as exc:
        summary = format_failures(exc, world_size=plan.nproc_per_node if plan.nnodes == 1 else None)
        print(summary if summary is not None else exc.format_msg(), file=sys.stderr)
        return 1
    except SignalException as exc:  # Ctrl-C / SIGTERM: torchrun has already passed it on to the ranks
        print(f"zerospeed launch: stopped by signal {int(exc.sigval)}", file=sys.stderr)
        return 128 + int(exc.sigval)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        api_log.removeFilter(_DropWorkerFailedLog)
    return 0
