"""`zerospeed.comm.log_summary()`: DeepSpeed's comms-logger table (`deepspeed.comm.log_summary`).

Per collective and message size: calls, total and average latency (ms; the average a 10%-trimmed mean, as
DeepSpeed's), algorithmic and bus bandwidth (Gbps = 1e9 bits/s, DeepSpeed's formulas of `calc_bw_log`: n ranks,
S bytes, t seconds - all-reduce algbw 2S/t and busbw 2(n-1)/n S/t; all-gather / reduce-scatter S/t and
(n-1)/n S/t with S the full, gathered size; all-to-all S/t and (n-1)/n S/t; broadcast, send, recv S/t for both;
the bus bandwidth formulas are NCCL-tests', Jeaugey 2018). Differences from DeepSpeed, all stated: the collectives
counted are the engines' own (each engine built with `"comms_logger": {"enabled": true}`, all of them together),
under zerospeed's names (`all_gather`, `reduce_scatter`, `all_to_all`: the full size); n is the size of each
call's own process group (DeepSpeed uses the world size); and the straggler breakdown covers the (op, size) rows
every rank recorded equally often (point-to-point rows differ per rank: DeepSpeed would all-reduce mismatched
lists), the others are named as skipped.
"""
from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from .logger import CommsLogger, live_loggers

COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
           "busbw_avg (Gbps)")
STRAGGLER_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total comm lat(ms)", "Total straggler(ms)",
                     "Avg comm lat(ms)", "Avg straggler(ms)")


def bandwidths(op: str, nbytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algorithmic, bus) bandwidth in Gbps of one call: `nbytes` (this rank's recorded message: the full size
    for all-gather / reduce-scatter) in `seconds` over a group of `ranks`. Unknown op names: (S/t, S/t)."""
    if seconds <= 0:
        return 0.0, 0.0
    rate = nbytes / seconds * 8 / 1e9
    n = max(ranks, 1)
    if op == "all_reduce":
        return 2 * rate, rate * 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return rate, rate * (n - 1) / n
    return rate, rate


def trim_mean(values: list[float], fraction: float = 0.1) -> float:
    """The mean of `values` without the round(len x fraction) smallest and largest (DeepSpeed's `trim_mean`)."""
    if not values:
        return 0.0
    data = sorted(values)
    k = int(round(len(data) * fraction))
    kept = data[k:len(data) - k] or data
    return sum(kept) / len(kept)


def convert_size(nbytes: int) -> str:
    """'678.86 MB' (powers of 1024), as DeepSpeed's `convert_size`."""
    if nbytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(int(math.floor(math.log(nbytes, 1024))), len(names) - 1)
    return f"{round(nbytes / 1024 ** i, 2)} {names[i]}"


def merged_calls(loggers: list[CommsLogger]) -> dict[str, dict[int, list[tuple[float, int]]]]:
    """Every logger's calls together: op -> message size -> [(seconds, ranks)], in op then size order."""
    out: dict[str, dict[int, list]] = {}
    for logger in loggers:
        for op, sizes in logger.calls.items():
            for size, calls in sizes.items():
                out.setdefault(op, {}).setdefault(size, []).extend(calls)
    return {op: dict(sorted(out[op].items())) for op in sorted(out)}


def _row(values, widths=20) -> str:
    return "".join(f"{v:<{widths}}" for v in values)


def log_all(calls: dict, *, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False):
    """Tabulate `calls` (`merged_calls`); with `show_straggler`, collective over the world. Returns DeepSpeed's
    dictionary ({"summary", "straggler_analysis", "metadata"}) if `return_dict`, else None."""
    initialized = dist.is_available() and dist.is_initialized()
    result = {"summary": {}, "straggler_analysis": None,
              "metadata": {"world_size": dist.get_world_size() if initialized else 1,
                           "rank": dist.get_rank() if initialized else 0,
                           "timestamp": datetime.datetime.now().isoformat()}}
    lines = [_row(COLUMNS)]
    for op, sizes in calls.items():
        lines.append(op)
        result["summary"][op] = {}
        for size, entries in sizes.items():
            lat_ms = [s * 1e3 for s, _ in entries]
            bws = [bandwidths(op, size, s, n) for s, n in entries]
            row = {"count": len(entries), "total_latency_ms": sum(lat_ms), "avg_latency_ms": trim_mean(lat_ms),
                   "tput_avg_gbps": trim_mean([a for a, _ in bws]), "busbw_avg_gbps": trim_mean([b for _, b in bws]),
                   "msg_size_bytes": size, "msg_size_str": convert_size(size)}
            result["summary"][op][size] = row
            lines.append(_row(["", row["msg_size_str"], row["count"], f"{row['total_latency_ms']:.2f}",
                               f"{row['avg_latency_ms']:.2f}", f"{row['tput_avg_gbps']:.2f}",
                               f"{row['busbw_avg_gbps']:.2f}"]))
    if show_straggler:
        result["straggler_analysis"], more = _stragglers(calls, initialized)
        lines += ["_______________________________", "Breakdown with straggler effect",
                  "-------------------------------", *more]
    if print_log:
        print("\n".join(lines))
    return result if return_dict else None


def _stragglers(calls: dict, initialized: bool) -> tuple[dict, list[str]]:
    """Per (op, size) every rank recorded equally often: the world's fastest latency of each call (all-reduce
    MIN) and this rank's wait beyond it. Collective over the world."""
    keys = {(op, size): len(entries) for op, sizes in calls.items() for size, entries in sizes.items()}
    everyone = [keys]
    if initialized and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, keys)
    common = [k for k in sorted(keys) if all(other.get(k) == keys[k] for other in everyone)]
    skipped = sorted({k for other in everyone for k in other} - set(common))
    out: dict = {}
    lines = [_row(STRAGGLER_COLUMNS)]
    for op in dict.fromkeys(op for op, _ in common):
        lines.append(op)
        out[op] = {}
        for _, size in (k for k in common if k[0] == op):
            mine = torch.tensor([s * 1e3 for s, _ in calls[op][size]], dtype=torch.float64)
            fastest = mine.clone()
            if initialized and dist.get_world_size() > 1:
                dist.all_reduce(fastest, op=dist.ReduceOp.MIN)
            wait = (mine - fastest).tolist()
            row = {"count": len(wait), "total_comm_lat_ms": float(fastest.sum()), "total_straggler_ms": sum(wait),
                   "avg_comm_lat_ms": trim_mean(fastest.tolist()), "avg_straggler_ms": trim_mean(wait),
                   "msg_size_bytes": size, "msg_size_str": convert_size(size)}
            out[op][size] = row
            lines.append(_row(["", row["msg_size_str"], row["count"], f"{row['total_comm_lat_ms']:.2f}",
                               f"{row['total_straggler_ms']:.2f}", f"{row['avg_comm_lat_ms']:.2f}",
                               f"{row['avg_straggler_ms']:.2f}"]))
    if skipped:
        lines.append("not on every rank equally often (no straggler figures): " +
                     ", ".join(f"{op} {convert_size(size)}" for op, size in skipped))
    return out, lines


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """Print the comms logger's table on global rank 0 (DeepSpeed's `deepspeed.comm.log_summary`): every
    collective the engines of this process recorded (`"comms_logger": {"enabled": true}`), per op and message
    size. Collective over the world (barriers around it, as DeepSpeed's; `show_straggler` all-reduces each row's
    latencies). Returns, on every rank, DeepSpeed's dictionary of the same figures if `return_dict`, else None."""
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        dist.barrier()
    result = log_all(merged_calls(live_loggers()), print_log=not initialized or dist.get_rank() == 0,
                     show_straggler=show_straggler, return_dict=return_dict)
    if initialized:
        dist.barrier()
    return result


def reset_log() -> None:
    """Forget every live logger's records (DeepSpeed's `deepspeed.comm.reset_log`)."""
    for logger in live_loggers():
        logger.reset()
