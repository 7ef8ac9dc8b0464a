"""The host-memory and disk budget of one ZeRO-3 rank with offload: what grows with the model, what does not.

ZeRO-Infinity, Rajbhandari et al. 2021, §5: with the parameters, gradients and optimizer states on
NVMe, what a rank keeps in memory is set by the largest gather unit (a transformer block) and the
buffer settings, not by the number of parameters Ψ. `rank_budget` adds up, in bytes per rank:

host (the compute device's working set is counted here too: on a CPU machine it is host memory)
  param_pool        offload_param nvme: max(buffer_count, 2) buffers of one unit's shard (unit / N)
  param_resident    shards kept in memory: max_in_cpu elements (nvme), or all Ψ/N (cpu / no offload)
  optimizer         nvme: buffer sets (2 with pipeline_read/write) x (master + states + gradient) x a
                    tile of min(sub_group_size, unit / N) fp32 elements; cpu / none: (1 + states) x 4 x Ψ/N
                    (+ 4 x Ψ/N fp32 masters under mixed precision without optimizer offload)
  gradients         nvme optimizer: two unit shards being written (4 B, or 2 B under bf16/fp16 with one
                    micro-step); else the fp32 gradient partition 4 x Ψ/N
  backward_steps    super_offload (stage 3, nvme optimizer): 6 buffer sets x (master + states + gradient)
                    x a tile, and up to 4 unit shards of fp32 gradients waiting to be stepped
  gathered          the unit in use and the prefetched ones: (1 + ceil(prefetch / unit)) x unit, param dtype
                    (released buffers `hostmem.GatheredPool` keeps for the next gather included: live + idle
                    never exceeds the most bytes live at once, and idle ones go before a cache maps anew)
  backward          one unit's full gradients and the reduce-scatter bucket (units are added to it until it
                    holds reduce_bucket_size elements): unit + max(unit, bucket), param dtype
  recycled          storages `hostmem.recycled` holds beyond the above (per byte size never more than were in use
                    at once): the second reduce-scatter bucket of one unit with its receive workspace (N + N - 1
                    unit shards, param dtype; the workspace is used on gloo, counted everywhere: one bucket is
                    reduced while the next is filled, stage 3 keeps no more in flight under offload) and an
                    fp32 gradient shard, at most RECYCLE_MAX_IDLE_BYTES
disk
  optimizer         (1 + states) x 4 x Ψ/N (master + Adam's two moments, fp32)
  gradients         (stage 3, optimizer on nvme) 4 x Ψ/N, or 2 x Ψ/N under bf16/fp16 with one micro-step
  param             (offload_param nvme) param bytes x (Ψ/N - max_in_cpu)

Not counted: the process itself (torch, the process group: the pre-flight adds the current RSS),
activations (the model's and the batch's: use activation checkpointing for large models) and the
allocator's slack. `bench/bench_offload.py --largest` prints the prediction next to the measured peak.
"""
from __future__ import annotations

from dataclasses import dataclass

from .hostmem import RECYCLE_MAX_IDLE_BYTES
from .policy import OffloadPolicy

__all__ = ["RankBudget", "rank_budget", "largest_model"]

FP32 = 4
BACKWARD_SETS, BACKWARD_PENDING = 6, 3  # super_offload's `BackwardSteps(sets=, max_pending=)`; at 4B bf16 a step
# took 91.2 s with 3 / 2 and 84.2 s with 6 / 3 (one run each, two sittings: bench/README session 17)
FORWARD_SHARE = 0.25  # ... and `defer_fraction`: the backward computes ~3/4 of a checkpointed step's work


@dataclass(frozen=True)
class RankBudget:
    """Bytes per rank: host {component: bytes} and disk {"optimizer" | "gradients" | "param": bytes}."""

    host: dict
    disk: dict

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def disk_total(self) -> int:
        return sum(self.disk.values())

    def describe(self) -> str:
        """'param_pool 1.2 GB + optimizer 320 MB + ...' (nonzero components, largest first)."""
        from .preflight import format_bytes

        parts = sorted(((n, b) for n, b in self.host.items() if b), key=lambda x: -x[1])
        return " + ".join(f"{n} {format_bytes(b)}" for n, b in parts) or "0"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rank_budget(policy: OffloadPolicy, *, numel: int, largest_unit: int, world: int, param_bytes: int,
                mixed: bool = False, grad_accum: int = 1, states: int = 2, stage: int = 3,
                prefetch_bucket_size: int = 50_000_000, reduce_bucket_size: int = 500_000_000) -> RankBudget:
    """One rank's budget (see the module docstring). numel: trainable parameters Ψ; largest_unit: elements
    of the largest stage-3 gather unit; world: data-parallel ranks N; param_bytes: bytes per element of the
    parameter dtype; mixed: bf16/fp16 with fp32 masters; grad_accum: micro-steps per step; states:
    elementwise optimizer states per element (Adam 2); prefetch / reduce bucket sizes in elements.
    Stages 1-2 hold the whole parameters and gradients (their offload moves only the optimizer tier).
    Raises ValueError for sizes < 1."""
    if min(numel, largest_unit, world, param_bytes) < 1:
        raise ValueError(f"rank_budget needs positive sizes, got numel={numel}, largest_unit={largest_unit}, "
                         f"world={world}, param_bytes={param_bytes}")
    shard, unit = _ceil_div(numel, world), min(largest_unit, numel)
    ushard = _ceil_div(unit, world)
    grad_bytes = param_bytes if mixed and grad_accum == 1 else FP32
    host, disk = {}, {}
    if stage < 3:  # parameters and gradients whole on every rank (stage 2: the gradient partition)
        host["param_resident"] = numel * param_bytes
        host["gradients"] = (shard if stage == 2 else numel) * FP32
    elif policy.param == "nvme":
        host["param_pool"] = max(policy.param_buffer_count, 2) * ushard * param_bytes
        host["param_resident"] = min(policy.max_in_cpu, shard) * param_bytes
        disk["param"] = max(shard - policy.max_in_cpu, 0) * param_bytes
    else:
        host["param_resident"] = shard * param_bytes
    if policy.optimizer == "nvme":
        grads_on_disk = stage == 3
        tile = min(policy.sub_group_size, ushard if stage == 3 else shard)
        sets = 2 if policy.pipeline else 1
        host["optimizer"] = sets * (1 + states + grads_on_disk) * tile * FP32
        disk["optimizer"] = (1 + states) * FP32 * shard
        if grads_on_disk:
            host["gradients"] = 2 * ushard * grad_bytes
            disk["gradients"] = shard * grad_bytes
        if grads_on_disk and policy.super_offload:  # BackwardSteps: its buffer sets + the fp32 gradients it holds
            host["backward_steps"] = (BACKWARD_SETS * (2 + states) * tile + (BACKWARD_PENDING + 1) * ushard) * FP32
    else:
        host["optimizer"] = (1 + states if policy.optimizer == "cpu" or mixed else states) * FP32 * shard
    if stage == 3:
        host.setdefault("gradients", shard * FP32)
        host["gathered"] = (1 + max(1, _ceil_div(prefetch_bucket_size, unit))) * unit * param_bytes
        host["backward"] = (unit + max(unit, min(reduce_bucket_size, numel))) * param_bytes
        host["recycled"] = min(RECYCLE_MAX_IDLE_BYTES, sum({(2 * world - 1) * param_bytes * ushard, FP32 * ushard}))
    return RankBudget(host, disk)


def largest_model(*, ram_bytes: int, disk_bytes: int, ranks: int, process_bytes: int, budget_of) -> tuple[int, str]:
    """The largest Ψ whose budget fits: `budget_of(numel) -> RankBudget` for one rank, `ranks` ranks on the
    node sharing `ram_bytes` of RAM (each also costing `process_bytes`) and `disk_bytes` of free disk.
    Returns (Ψ, what limits it: "disk" | "host memory"); Ψ = 0 when not even 1e6 parameters fit. Bisection
    over Ψ (the budget is monotone in Ψ)."""
    def fits(n):
        b = budget_of(n)
        return ranks * (b.host_total + process_bytes) <= ram_bytes and ranks * b.disk_total <= disk_bytes
    lo, hi = 0, 10**6
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 10**15:
            return lo, "nothing (the budget does not grow with the model)"
    while hi - lo > max(lo // 1000, 1):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    b = budget_of(hi)
    limit = "disk" if ranks * b.disk_total > disk_bytes else "host memory"
    return lo, limit
