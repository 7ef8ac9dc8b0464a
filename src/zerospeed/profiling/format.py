"""Number formatting and text layout for the flops profiler.

The string formats follow DeepSpeed's flops profiler so logs and scripts that parse them keep
working: a value is scaled to the largest SI prefix it reaches (T, G, M, K, none, m, u), rounded
to `precision` decimals and printed with ``:g`` ("1.23 G", "0 ", "12.5 m").
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_PRECISION = 2

_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6))


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Format `num` with an SI prefix: 1.5e9 -> "1.5 G", 0 -> "0 ", 2e-3 -> "2 m".

    units: force one prefix ("T", "G", "M", "K", "", "m", "u") instead of choosing one.
    Raises ValueError for an unknown prefix.
    """
    if units is None:
        units, magnitude = "u", 1e-6
        if num == 0:
            units, magnitude = "", 1.0
        else:
            for prefix, scale in _PREFIXES:
                if abs(num) >= scale:
                    units, magnitude = prefix, scale
                    break
    else:
        table = dict(_PREFIXES)
        if units not in table:
            raise ValueError(f"unknown unit prefix {units!r}; use one of {sorted(table)}")
        magnitude = table[units]
    return f"{round(num / magnitude, precision):g} {units}"


def flops_to_string(flops_per_s: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Format a rate in floating-point operations per second: 2.5e12 -> "2.5 TFLOPS"."""
    return f"{number_to_string(flops_per_s, units, precision)}FLOPS"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Format a count of multiply-accumulate operations: 4.3e8 -> "430 MMACs"."""
    return f"{number_to_string(macs, units, precision)}MACs"


def params_to_string(params: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Format a parameter count, billions as "B": 61706 -> "61.71 K", 7e9 -> "7 B"."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Format a duration given in seconds: 0.0123 -> "12.3 ms"."""
    return f"{number_to_string(seconds, units, precision)}s"


def bytes_to_string(num_bytes: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Format a size in bytes with decimal prefixes: 2.5e6 -> "2.5 MB"."""
    return f"{number_to_string(num_bytes, units, precision)}B"


def percent(part: float, whole: float) -> float:
    """100 * part / whole rounded to 2 decimals; 0 when whole is 0."""
    return round(100.0 * part / whole, DEFAULT_PRECISION) if whole else 0.0


@dataclass(frozen=True)
class ModuleStats:
    """Profile of one module for one profiled window.

    name: fully qualified name ("" for the root). kind: class name. depth: number of name parts
    (root 0). params: parameter elements held by the module and its children (each tensor once).
    flops / macs: forward floating-point operations and multiply-accumulates, the module's
    children included. duration: forward wall time in seconds, summed over calls.
    extra: the module's own `extra_repr()`.
    """

    name: str
    kind: str
    depth: int
    params: int
    flops: int
    macs: int
    duration: float
    extra: str = ""


def line(label: str, value: object) -> str:
    """One summary line, label padded to 70 columns as in DeepSpeed's report."""
    return f"{label:<70}  {value}"


def aggregated_lines(stats: Iterable[ModuleStats], module_depth: int, top_modules: int) -> list[str]:
    """Top `top_modules` module classes per depth by params, MACs and forward latency.

    Modules of one class at one depth are summed. Depths 0 .. module_depth-1 are shown
    (DeepSpeed's convention); module_depth=-1 shows every depth.
    """
    per_depth: dict[int, dict[str, list[float]]] = {}
    for s in stats:
        acc = per_depth.setdefault(s.depth, {}).setdefault(s.kind, [0, 0, 0.0])
        acc[0] += s.params
        acc[1] += s.macs
        acc[2] += s.duration
    last = max(per_depth, default=-1) + 1 if module_depth == -1 else module_depth
    out = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for d in range(last):
        info = per_depth.get(d, {})
        if not info:
            continue

        def top(col: int, fmt) -> dict[str, str]:
            ranked = sorted(info.items(), key=lambda kv: kv[1][col], reverse=True)[:top_modules]
            return {k: fmt(v[col]) for k, v in ranked}

        out.append(f"depth {d}:")
        out.append(f"    params      - {top(0, params_to_string)}")
        out.append(f"    MACs        - {top(1, macs_to_string)}")
        out.append(f"    fwd latency - {top(2, duration_to_string)}")
    return out


def detailed_lines(stats: Sequence[ModuleStats], totals: Mapping[str, float], module_depth: int = -1) -> list[str]:
    """The module tree, one line per module, indented by depth and named by its full name.

    totals: {"params", "macs", "duration"} of the root, for the percentages. Each line reads
    `name: Class(params = % Params, MACs = % MACs, latency = % latency, FLOPS[, extra_repr])`.
    module_depth >= 0 stops the tree below that depth.
    """
    out = []
    for s in stats:
        if 0 <= module_depth < s.depth:
            continue
        items = [
            f"{params_to_string(s.params)} = {percent(s.params, totals['params']):g}% Params",
            f"{macs_to_string(s.macs)} = {percent(s.macs, totals['macs']):g}% MACs",
            f"{duration_to_string(s.duration)} = {percent(s.duration, totals['duration']):g}% latency",
            flops_to_string(s.flops / s.duration if s.duration else 0.0),
        ]
        if s.extra:
            items.append(s.extra)
        label = s.name or "(root)"
        out.append(f"{'  ' * s.depth}{label}: {s.kind}({', '.join(items)})")
    return out


_NOTATIONS = [
    "Notations:",
    "data parallel size (dp_size), model parallel size(mp_size),",
    "number of parameters (params), number of multiply-accumulate operations(MACs),",
    "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
    "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
    "step (weights update latency), iter latency (sum of fwd, bwd and step latency),",
    "MFU (model FLOPs utilisation = achieved FLOPS / peak FLOPS of one device)",
]


def summary_lines(*, step: int, params: int, flops: int, macs: int, fwd: float, peak: float, peak_source: str,
                  bwd: float | None = None, step_latency: float | None = None, recompute_fwd_factor: float = 0.0,
                  engine: Mapping[str, int] | None = None) -> list[str]:
    """The report's summary: sizes, forward work and latency, achieved FLOP/s and MFU.

    All latencies in seconds, peak in FLOP/s. engine: optional {"world_size", "dp_world_size",
    "mp_world_size", "batch_size"} (missing keys are skipped; mp_world_size defaults to 1).
    Backward lines need bwd; iteration, MFU-per-step and samples/s lines also need step_latency.
    Backward work is taken as (2 + recompute_fwd_factor) x forward FLOPs.
    """
    engine = dict(engine or {})
    mp = int(engine.get("mp_world_size", 1) or 1)
    out = ["", "-------------------------- zerospeed Flops Profiler --------------------------",
           f"Profile Summary at step {step}:", *_NOTATIONS, ""]
    for label, key in (("world size: ", "world_size"), ("data parallel size: ", "dp_world_size"),
                       ("model parallel size: ", "mp_world_size"), ("batch size per device: ", "batch_size")):
        if key in engine:
            out.append(line(label, engine[key]))
    fwd_rate = flops / fwd if fwd > 0 else 0.0
    out += [line("params per device: ", params_to_string(params)),
            line("params of model = params per device * mp_size: ", params_to_string(params * mp)),
            line("fwd MACs per device: ", macs_to_string(macs)),
            line("fwd flops per device: ", number_to_string(flops)),
            line("fwd flops of model = fwd flops per device * mp_size: ", number_to_string(flops * mp)),
            line("fwd latency: ", duration_to_string(fwd)),
            line("fwd FLOPS per device = fwd flops per device / fwd latency: ", flops_to_string(fwd_rate)),
            line(f"peak FLOPS per device ({peak_source}): ", flops_to_string(peak)),
            line("fwd MFU = fwd FLOPS per device / peak FLOPS: ", f"{100 * fwd_rate / peak:.2f} %")]
    if bwd is None or bwd <= 0:
        return out
    bf = 2.0 + recompute_fwd_factor
    out += [line("bwd latency: ", duration_to_string(bwd)),
            line(f"bwd FLOPS per device = {bf:g} * fwd flops per device / bwd latency: ",
                 flops_to_string(bf * flops / bwd)),
            line(f"fwd+bwd FLOPS per device = {bf + 1:g} * fwd flops per device / (fwd+bwd latency): ",
                 flops_to_string((bf + 1) * flops / (fwd + bwd)))]
    if step_latency is None:
        return out
    it = fwd + bwd + step_latency
    rate = (bf + 1) * flops / it
    out += [line("step latency: ", duration_to_string(step_latency)),
            line("iter latency: ", duration_to_string(it)),
            line(f"FLOPS per device = {bf + 1:g} * fwd flops per device / iter latency: ", flops_to_string(rate)),
            line("MFU = FLOPS per device / peak FLOPS: ", f"{100 * rate / peak:.2f} %")]
    if "batch_size" in engine:
        world = int(engine.get("world_size", 1) or 1)
        out.append(line("samples/second: ", round(engine["batch_size"] * world / it, 2)))
    return out
