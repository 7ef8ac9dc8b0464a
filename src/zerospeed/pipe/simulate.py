"""Check and time pipeline schedules (``zerospeed.pipe.schedule``) without processes or tensors.

``validate`` proves a schedule is a correct order; ``simulate`` runs it as list scheduling (each rank
executes its actions in the given order, as early as its dependencies allow) and returns the step
time, bubble fraction, busy time and peak in-flight activations per rank; ``best_schedule`` picks the
fastest implemented schedule for measured per-stage times.

Execution model (both functions): computations take their stage's time; a send is eager (never
blocks: ``isend``) but costs the sending rank ``send_overhead`` seconds (the call itself: gloo writes
the message to its socket in the caller's thread); a receive blocks until the matching send ran and
its message arrived ``send_latency`` seconds later. Messages between one pair of ranks are matched in
order (the k-th receive on rank b from rank a takes the k-th send from a to b), as point-to-point
ops on one process group are. Markers (loads, gradient reduction, optimizer step) take no time.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from zerospeed.pipe.schedule import (COMM, COMPUTE, MARKERS, Backward, BackwardInput, BackwardWeight, Forward,
                                     OptimizerStep, RecvActivation, RecvGrad, Schedule, SendActivation, SendGrad,
                                     candidate_schedules, message_key, stage_owners)

PerStage = Union[float, Sequence[float]]


@dataclass(frozen=True)
class StageTimes:
    """Seconds per micro-batch for the layers one pipeline rank holds, and per message.

    ``forward``, ``backward_input`` (B) and ``backward_weight`` (W) are each one number for every
    pipeline stage or a sequence with one entry per pipeline stage (rank). A fused ``Backward``
    costs B + W. With ``chunks`` model chunks per rank (interleaved schedules) each chunk costs
    1/chunks of its rank's time, so one ``StageTimes`` compares every schedule on the same model.
    ``send_latency``: seconds from a send to its message being receivable (default 0).
    ``send_overhead``: seconds the sending rank spends in each send (default 0): step time, not busy
    time. Measured on this CPU with gloo: ~0.1 ms per 128 KiB activation to an idle peer, 0.3-0.5 ms
    inside a running pipeline (bench/bench_pipe.py times it per run).
    ``pass_overhead``: seconds of the executor's own work per computation (default 0), counted as busy
    time: posting the receives ahead of it, the hand-off between model stages on one rank, bookkeeping.
    A schedule with c chunks per rank pays it c times per micro-batch, which matters when a pass is a
    few milliseconds (bench/bench_pipe.py measures it per run: ~0.5-1.5 ms here under load).
    """
    forward: PerStage = 1.0
    backward_input: PerStage = 1.0
    backward_weight: PerStage = 1.0
    send_latency: float = 0.0
    send_overhead: float = 0.0
    pass_overhead: float = 0.0

    def _at(self, name: str, rank: int, num_ranks: int) -> float:
        value = getattr(self, name)
        if isinstance(value, (int, float)):
            return float(value)
        if len(value) != num_ranks:
            raise ValueError(f"StageTimes.{name} has {len(value)} entries but the schedule has {num_ranks} "
                             f"pipeline stages; give one number, or one per stage")
        return float(value[rank])

    def check(self, num_ranks: int) -> None:
        """Raise ValueError if a time is negative or a sequence has the wrong length."""
        for name in ("forward", "backward_input", "backward_weight"):
            for rank in range(num_ranks):
                if self._at(name, rank, num_ranks) < 0:
                    raise ValueError(f"StageTimes.{name} is negative on stage {rank}; times are seconds >= 0")
        for name in ("send_latency", "send_overhead", "pass_overhead"):
            if getattr(self, name) < 0:
                raise ValueError(f"StageTimes.{name} is {getattr(self, name)}; it is seconds >= 0")


@dataclass(frozen=True)
class Result:
    """What one simulated batch costs.

    ``step_time``: seconds from the first action to the last rank's end (the makespan).
    ``bubble_fraction``: ``1 - sum(per_rank_busy) / (ranks * step_time)``, idle share in [0, 1).
    ``per_rank_busy``: seconds of computation per rank.
    ``peak_activations_per_rank``: the most (micro-batch, model stage) pairs a rank held at once
    whose forward ran and whose input-gradient pass (``BackwardInput`` or ``Backward``) had not; with
    ``chunks`` chunks per rank one pair is 1/chunks of the rank's layers.
    """
    step_time: float
    bubble_fraction: float
    per_rank_busy: tuple[float, ...]
    peak_activations_per_rank: tuple[int, ...]


def _fail(rank: int, index: int, action, reason: str) -> ValueError:
    return ValueError(f"rank {rank}, action {index} {action}: {reason}")


def _check_order(schedule: Schedule, owner: Mapping[int, int], num_model_stages: int, num_microbatches: int) -> None:
    """Per-rank static checks: ranges, local dependencies, neighbours, duplicates, completeness."""
    last = num_model_stages - 1
    done: dict[tuple[type, int, int], int] = {}
    for rank in sorted(schedule):
        seen: set = set()
        step_at = None
        for i, a in enumerate(schedule[rank]):
            if isinstance(a, OptimizerStep):
                step_at = i
            if not hasattr(a, "microbatch"):
                continue
            mb, s = a.microbatch, a.stage
            if not 0 <= mb < num_microbatches:
                raise _fail(rank, i, a, f"micro-batch {mb} is outside 0..{num_microbatches - 1}")
            if not 0 <= s <= last:
                raise _fail(rank, i, a, f"model stage {s} is outside 0..{last}")
            if owner.get(s) != rank:
                raise _fail(rank, i, a, f"model stage {s} is computed on rank {owner.get(s)}, not here")
            if a in seen:
                raise _fail(rank, i, a, "appears twice on this rank; each action runs once per batch")
            if step_at is not None and isinstance(a, COMPUTE):
                raise _fail(rank, i, a, f"runs after OptimizerStep (action {step_at}); move the step to the end")
            if isinstance(a, Forward):
                if s > 0:
                    need = Forward(mb, s - 1) if owner.get(s - 1) == rank else RecvActivation(mb, s, s - 1)
                    if need not in seen:
                        raise _fail(rank, i, a, f"runs before its input is here: put {need} before it")
            elif isinstance(a, (Backward, BackwardInput)):
                if Forward(mb, s) not in seen:
                    raise _fail(rank, i, a, f"backward precedes its forward: put Forward({mb}, {s}) before it")
                if s < last:
                    if owner.get(s + 1) == rank:
                        ok = Backward(mb, s + 1) in seen or BackwardInput(mb, s + 1) in seen
                        need = f"the backward of micro-batch {mb} on stage {s + 1}"
                    else:
                        ok = RecvGrad(mb, s, s + 1) in seen
                        need = RecvGrad(mb, s, s + 1)
                    if not ok:
                        raise _fail(rank, i, a, f"runs before its output gradient is here: put {need} before it")
            elif isinstance(a, BackwardWeight):
                if BackwardInput(mb, s) not in seen:
                    raise _fail(rank, i, a, f"weight-gradient pass precedes its input-gradient pass: put "
                                            f"BackwardInput({mb}, {s}) before it")
            elif isinstance(a, (SendActivation, RecvActivation, SendGrad, RecvGrad)):
                want = s + 1 if isinstance(a, (SendActivation, RecvGrad)) else s - 1
                if not 0 <= want <= last:
                    raise _fail(rank, i, a, f"model stage {s} has no neighbour {want} to exchange this with; "
                                            f"drop the message")
                if a.peer != want:
                    raise _fail(rank, i, a, f"peer must be the neighbouring model stage {want}")
                if owner.get(a.peer) == rank:
                    raise _fail(rank, i, a, f"stage {a.peer} is on this rank too; drop the message")
                if isinstance(a, SendActivation) and Forward(mb, s) not in seen:
                    raise _fail(rank, i, a, f"sends an activation before Forward({mb}, {s}) produced it")
                if isinstance(a, SendGrad) and not (Backward(mb, s) in seen or BackwardInput(mb, s) in seen):
                    raise _fail(rank, i, a, f"sends a gradient before the backward of ({mb}, {s}) produced it")
            seen.add(a)
            if isinstance(a, COMPUTE):
                done[(type(a), mb, s)] = rank
    for s in range(num_model_stages):
        for mb in range(num_microbatches):
            fused = (Backward, mb, s) in done
            split = [(k, mb, s) in done for k in (BackwardInput, BackwardWeight)]
            missing = None
            if (Forward, mb, s) not in done:
                missing = "forward"
            elif fused and any(split):
                missing = "nothing: it has both a fused Backward and a split backward; keep one"
            elif not fused and not all(split):
                missing = "weight-gradient pass (BackwardWeight)" if split[0] else "backward"
            if missing:
                raise ValueError(f"micro-batch {mb} on model stage {s} (rank {owner.get(s)}) misses its {missing}")


def _run(schedule: Schedule, owner: Mapping[int, int], times: StageTimes, chunks: int) -> Result:
    """Execute with blocking receives; raise ValueError on a mismatched message or a deadlock."""
    ranks = sorted(schedule)
    n = len(ranks)
    pos = {r: 0 for r in ranks}
    clock = {r: 0.0 for r in ranks}
    busy = {r: 0.0 for r in ranks}
    live = {r: 0 for r in ranks}
    peak = {r: 0 for r in ranks}
    channels: dict[tuple[int, int], deque] = {}
    while True:
        advanced = False
        for r in ranks:
            actions = schedule[r]
            while pos[r] < len(actions):
                a = actions[pos[r]]
                if isinstance(a, (RecvActivation, RecvGrad)):
                    queue = channels.get((owner[a.peer], r))
                    if not queue:
                        break
                    sent, at = queue.popleft()
                    if sent != message_key(a):
                        raise _fail(r, pos[r], a, f"the next message from rank {owner[a.peer]} is {sent} "
                                                  f"(kind, micro-batch, from stage, to stage): receives must "
                                                  f"come in the order of the sends")
                    clock[r] = max(clock[r], at + times.send_latency)
                elif isinstance(a, (SendActivation, SendGrad)):
                    clock[r] += times.send_overhead
                    channels.setdefault((r, owner[a.peer]), deque()).append((message_key(a), clock[r]))
                elif isinstance(a, COMPUTE):
                    f = times._at("forward", r, n) / chunks
                    b = times._at("backward_input", r, n) / chunks
                    w = times._at("backward_weight", r, n) / chunks
                    cost = {Forward: f, BackwardInput: b, BackwardWeight: w, Backward: b + w}[type(a)]
                    cost += times.pass_overhead
                    clock[r] += cost
                    busy[r] += cost
                    if isinstance(a, Forward):
                        live[r] += 1
                        peak[r] = max(peak[r], live[r])
                    elif isinstance(a, (Backward, BackwardInput)):
                        live[r] -= 1
                pos[r] += 1
                advanced = True
        if all(pos[r] == len(schedule[r]) for r in ranks):
            break
        if not advanced:
            waits = "; ".join(f"rank {r} waits at action {pos[r]} {schedule[r][pos[r]]}"
                              for r in ranks if pos[r] < len(schedule[r]))
            raise ValueError(f"deadlock: no rank can advance ({waits}); reorder the receives so each one's "
                             f"send can run first")
    left = {key: [m for m, _ in q] for key, q in channels.items() if q}
    if left:
        (src, dst), msgs = next(iter(left.items()))
        raise ValueError(f"rank {src} sends {msgs[0]} to rank {dst}, which never receives it; add the receive")
    step = max(clock.values()) if clock else 0.0
    total = sum(busy.values())
    bubble = 1.0 - total / (n * step) if step > 0 else 0.0
    return Result(step, bubble, tuple(busy[r] for r in ranks), tuple(peak[r] for r in ranks))


def _prepare(schedule: Schedule, num_stages: int, num_microbatches: int | None, chunks: int):
    if not isinstance(schedule, Mapping) or sorted(schedule) != list(range(num_stages)):
        got = sorted(schedule) if isinstance(schedule, Mapping) else type(schedule).__name__
        raise ValueError(f"a schedule is {{rank: [actions]}} with ranks 0..{num_stages - 1}; got ranks {got}")
    for rank, actions in schedule.items():
        for i, a in enumerate(actions):
            if not isinstance(a, COMPUTE + COMM + MARKERS):
                raise _fail(rank, i, a, "is not an action of zerospeed.pipe.actions")
    owner = stage_owners(schedule)
    num_model_stages = num_stages * chunks
    missing = sorted(set(range(num_model_stages)) - set(owner))
    extra = sorted(set(owner) - set(range(num_model_stages)))
    if missing or extra:
        raise ValueError(f"{num_stages} ranks x {chunks} chunks make model stages 0..{num_model_stages - 1}, but "
                         f"stages {missing} have no computation and stages {extra} are out of range; check "
                         f"num_stages and chunks")
    if num_microbatches is None:
        num_microbatches = 1 + max(a.microbatch for acts in schedule.values() for a in acts if isinstance(a, COMPUTE))
    _check_order(schedule, owner, num_model_stages, num_microbatches)
    return owner


def validate(schedule: Schedule, num_stages: int, num_microbatches: int, *, chunks: int = 1) -> None:
    """Raise ValueError (naming the rank, the action and the reason) unless ``schedule`` is correct.

    ``num_stages`` pipeline ranks hold ``num_stages * chunks`` model stages. Checked: each
    backward after its forward on that stage, each ``BackwardWeight`` after its ``BackwardInput``;
    a forward after its input arrived (a receive from the previous stage, or that stage's forward on
    the same rank), a backward after its output gradient arrived; sends after what they send;
    every micro-batch has a forward and a backward (fused, or input + weight) on every model stage;
    sends matched by receives in order per (source rank, destination rank) pair, none left over;
    and a simulated run with blocking receives does not deadlock (the error names each waiting rank
    and the action it waits on).
    """
    owner = _prepare(schedule, num_stages, num_microbatches, chunks)
    _run(schedule, owner, StageTimes(), chunks)


def simulate(schedule: Schedule, times: StageTimes | None = None) -> Result:
    """Time one batch of a valid schedule under ``times`` (seconds; see ``StageTimes``).

    List scheduling: each rank runs its actions in order, each as early as the rank and the
    action's incoming message allow; the makespan is ``Result.step_time``. The schedule is
    validated first (ValueError as ``validate``); the number of chunks per rank is read off it.
    """
    times = times or StageTimes()
    num_stages = len(schedule)
    owner = stage_owners(schedule)
    chunks = max(1, len(owner) // max(1, num_stages))
    times.check(num_stages)
    owner = _prepare(schedule, num_stages, None, chunks)
    return _run(schedule, owner, times, chunks)


def best_schedule(num_stages: int, num_microbatches: int, times: StageTimes | None = None, *,
                  chunks: int = 2) -> tuple[str, Result]:
    """The fastest implemented schedule for these sizes and times: ``(name, Result)``.

    Candidates: ``candidate_schedules(num_stages, num_microbatches, chunks=chunks)`` (gpipe, 1f1b,
    zb_h1, zb_v, interleaved_1f1b when the micro-batches divide, dualpipev with at least 2 x stages of
    them). Ties on step time go to the lower
    peak activations, then to the earlier name in that order. Raises ValueError on sizes < 1.
    """
    best: tuple[str, Result] | None = None
    for name, build in candidate_schedules(num_stages, num_microbatches, chunks=chunks).items():
        result = simulate(build(), times)
        if best is None:
            best = (name, result)
            continue
        faster = result.step_time < best[1].step_time - 1e-12 * max(1.0, best[1].step_time)
        tie = not faster and result.step_time <= best[1].step_time + 1e-12 * max(1.0, best[1].step_time)
        if faster or (tie and max(result.peak_activations_per_rank) < max(best[1].peak_activations_per_rank)):
            best = (name, result)
    assert best is not None
    return best
