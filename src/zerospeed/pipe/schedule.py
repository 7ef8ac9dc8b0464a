"""Pipeline schedules as data (DESIGN.md rule 7): pure functions, no processes, no tensors.

A *schedule* is ``{rank: [action, ...]}``, the actions of `pipe.actions` (re-exported here): for each
pipeline rank, the ordered list of what it does in one training batch (``train_batch``). Actions are small frozen dataclasses naming a micro-batch
(0 .. num_microbatches-1) and a *model stage* (0 .. num_stages*chunks-1). With one chunk per rank the
model stage is the rank; with ``chunks`` model chunks per rank (interleaved 1F1B) model stage
``c*num_stages + r`` lives on rank ``r``. Which rank owns a stage is read off the compute actions, so
other layouts (a V shape) need no new type. ``zerospeed.pipe.simulate.validate`` checks a schedule;
``simulate`` times it.

Generators (``num_stages`` = pipeline ranks, as DeepSpeed's ``PipelineModule(num_stages=...)``;
``num_microbatches`` = micro-batches per batch = gradient_accumulation_steps):

* ``gpipe``: all forwards, then all backwards (Huang et al. 2019, GPipe).
* ``one_f_one_b``: DeepSpeed's ``TrainSchedule`` (Narayanan et al. 2019, PipeDream-Flush): stage
  ``s`` runs ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one backward.
* ``interleaved_1f1b``: Narayanan et al. 2021 §2.2, ``chunks`` model chunks per rank, in Megatron-LM's
  order (``megatron/core/pipeline_parallel/schedules.py``, groups of ``p`` micro-batches per chunk).
* ``zb_h1``: Qi et al. 2024 "Zero Bubble Pipeline Parallelism" §3.1: 1F1B's forwards and
  input-gradient passes with rank ``r`` deferring ``r`` weight-gradient passes into the cool-down
  bubble (the order of torch.distributed.pipelining's ``_get_1f1b_rank_ops(enable_zero_bubble=True)``
  with one chunk); same in-flight micro-batches as 1F1B.
* ``zb_v``: Qi et al. 2024 §6, two chunks per rank in a V (rank ``r`` holds stages ``r`` and
  ``2p - 1 - r``), torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` order.
* ``dualpipev``: DeepSeek-V3's DualPipeV on the same V, with its weight-gradient deferral.

``build_schedule(name, ...)`` builds one by name for a module's chunk layout; ``candidate_schedules``
lists those that apply to given sizes.

``interleaved_1f1b``, ``zb_h1`` and ``zb_v`` give the compute order of torch 2.13's
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` (one chunk) and
``ScheduleZBVZeroBubble``; ``one_f_one_b`` that of DeepSpeed's ``TrainSchedule`` (tests check all four).
"""
from __future__ import annotations

from typing import Callable

from .actions import (COMM, COMPUTE, MARKERS, Action, Backward, BackwardInput, BackwardWeight, Forward,  # noqa: F401
                      LoadMicroBatch, OptimizerStep, RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, Schedule,
                      SendActivation, SendGrad, _check_sizes, fuse_adjacent_backwards, message_key, stage_owners,
                      with_communication)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward in micro-batch order.

    Peak in-flight activations: ``num_microbatches`` on every rank. Raises ValueError on sizes < 1.
    """
    _check_sizes(num_stages, num_microbatches)
    orders = {s: [Forward(m, s) for m in range(num_microbatches)] + [Backward(m, s) for m in range(num_microbatches)]
              for s in range(num_stages)}
    return with_communication(orders, num_stages)


def _one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int, backward: type) -> list[Action]:
    """1F1B compute order of one stage: warm-up forwards, then one forward + one backward, then cool-down."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    order: list[Action] = [Forward(m, stage) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [Forward(warmup + i, stage), backward(i, stage)]
    order += [backward(m, stage) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B with fused backwards: the compute order of DeepSpeed's ``TrainSchedule`` on every stage.

    Stage ``s`` runs ``min(p - s - 1, m)`` warm-up forwards, then ``m - warmup`` pairs (forward,
    backward), then the remaining backwards; peak in-flight activations ``min(p - s, m)``. With equal
    per-stage times the bubble fraction is ``(p - 1) / (m + p - 1)``. Raises ValueError on sizes < 1.
    """
    _check_sizes(num_stages, num_microbatches)
    orders = {s: _one_f_one_b_order(s, num_stages, num_microbatches, Backward) for s in range(num_stages)}
    return with_communication(orders, num_stages)


def interleaved_1f1b(num_stages: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021 §2.2) with ``chunks`` model chunks per rank.

    ``num_stages`` ranks hold ``num_stages * chunks`` model stages, stage ``c * num_stages + r`` on
    rank ``r``. Megatron-LM's order (``forward_backward_pipelining_with_interleaving``): the k-th
    forward of a rank runs chunk ``(k // p) % chunks`` on micro-batch ``(k // (p * chunks)) * p + k % p``,
    backwards walk the chunks in reverse; warm-up ``(p - r - 1) * 2 + (chunks - 1) * p`` forwards
    (all of them if that is more), then one forward + one backward, then the cool-down backwards.
    Raises ValueError if ``num_microbatches`` is not a multiple of ``num_stages`` (Megatron's
    requirement: micro-batches go through each chunk in groups of ``p``).
    """
    _check_sizes(num_stages, num_microbatches, chunks)
    p, v, m = num_stages, chunks, num_microbatches
    if m % p:
        raise ValueError(f"interleaved 1F1B needs num_microbatches a multiple of num_stages: {m} micro-batches "
                         f"over {p} stages; use {m + p - m % p} (or {m - m % p}) micro-batches, or 1F1B")
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return (k // (p * v)) * p + k % p, chunk

    orders: dict[int, list[Action]] = {}
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        fwd = [Forward(mb, c * p + r) for mb, c in (unit(k, True) for k in range(total))]
        bwd = [Backward(mb, c * p + r) for mb, c in (unit(k, False) for k in range(total))]
        order: list[Action] = fwd[:warmup]
        for i in range(total - warmup):
            order += [fwd[warmup + i], bwd[i]]
        order += bwd[total - warmup:]
        orders[r] = order
    return with_communication(orders, p * v)


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1), one chunk per rank.

    The forwards and input-gradient passes (B) keep 1F1B's order, so the peak in-flight activations
    are 1F1B's (``min(p - s, m)``); rank ``r`` runs its first ``r`` steady-state B passes without
    their weight-gradient pass (W), then each B is followed by the oldest pending W, and the ``r``
    deferred W passes fill the cool-down bubble at the end. With T_F = T_B = T_W the bubble is about
    a third of 1F1B's. Raises ValueError on sizes < 1.
    """
    _check_sizes(num_stages, num_microbatches)
    orders: dict[int, list[Action]] = {}
    for r in range(num_stages):
        pending: list[int] = []
        order: list[Action] = []
        backwards = 0
        for a in _one_f_one_b_order(r, num_stages, num_microbatches, BackwardInput):
            order.append(a)
            if isinstance(a, BackwardInput):
                pending.append(a.microbatch)
                backwards += 1
                if backwards > r:
                    order.append(BackwardWeight(pending.pop(0), r))
        order += [BackwardWeight(mb, r) for mb in pending]
        orders[r] = order
    return with_communication(orders, num_stages)


def zb_v(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024 §6), two chunks per rank in a V: rank ``r`` holds model stages ``r`` and
    ``2p - 1 - r``, so the first and last model stages share rank 0 and stages ``p - 1`` and ``p``
    need no message.

    The order of torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` (torch 2.13,
    ``_calculate_single_rank_operations``): warm-up ``2(p - r) - 1`` chunk-0 forwards, ``r`` pairs
    (chunk-1 F, chunk-0 F), ``p - r`` triples (chunk-1 F, B, W); steady state F/B/W on chunk 0 then
    chunk 1; cool-down input-gradient passes with the deferred weight-gradient passes last. Planned for
    ``max(2p - 1, m)`` micro-batches and cut to ``m``. With T_F = T_B = T_W per chunk the bubble
    nearly vanishes for ``m >= 2p``; peak in-flight (micro-batch, chunk) pairs ``2p`` on rank 0, the
    activations of ``p`` whole stages, as 1F1B's first stage. Raises ValueError on sizes < 1.
    """
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    n_micro = max(2 * p - 1, m)
    orders: dict[int, list[Action]] = {}
    for r in range(p):
        chunk_stage = (r, 2 * p - 1 - r)
        count = {(kind, c): 0 for kind in (Forward, BackwardInput) for c in (0, 1)}

        def take(kind: type, c: int) -> Action:
            count[kind, c] += 1
            return kind(count[kind, c] - 1, chunk_stage[c])

        def fbw(c: int) -> list[Action]:
            b = take(BackwardInput, c)
            return [take(Forward, c), b, BackwardWeight(b.microbatch, b.stage)]

        ops: list[Action] = [take(Forward, 0) for _ in range(2 * (p - r) - 1)]
        for _ in range(r):
            ops += [take(Forward, 1), take(Forward, 0)]
        for _ in range(p - r):
            ops += fbw(1)
        while count[Forward, 1] < count[Forward, 0] or count[Forward, 0] < n_micro:
            if count[Forward, 0] < n_micro:
                ops.append(take(Forward, 0))
            b = take(BackwardInput, 0)
            ops += [b, BackwardWeight(b.microbatch, b.stage)] + fbw(1)
        w0, w1 = count[BackwardInput, 0], count[BackwardInput, 1]
        for _ in range(r):
            ops += [take(BackwardInput, 0), take(BackwardInput, 1)]
        for _ in range(p - r):
            ops += [take(BackwardInput, 0), BackwardWeight(w0, chunk_stage[0])]
            w0 += 1
        ops += [BackwardWeight(mb, chunk_stage[1]) for mb in range(w1, count[BackwardInput, 1])]
        ops += [BackwardWeight(mb, chunk_stage[0]) for mb in range(w0, count[BackwardInput, 0])]
        orders[r] = [a for a in ops if a.microbatch < m]
    return with_communication(orders, 2 * p)


def dualpipev(num_stages: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3 technical report §3.2.1; the "cut-in-half" DualPipe of deepseek-ai/DualPipe's
    `dualpipev.py`), two chunks per rank in a V: rank ``r`` holds model stages ``r`` (phase 0) and
    ``2p - 1 - r`` (phase 1), so micro-batches go out through phase 0 and come back through phase 1 to rank 0,
    which loads the data and computes the loss.

    The reference's eight steps (nF0, nF0F1, nB1W1F1, the main nF0B1F1B0, nB1F1B0, nB1B0, nWB0, nW), with its
    zero-bubble backwards: in steps 3 and 7 and the second half of step 6 the backward is the input-gradient
    pass alone, its weight-gradient pass queued and run at the next "W" (FIFO), as the reference's
    `WeightGradStore`; elsewhere the backward is fused. The forward/backward pairs the reference overlaps on
    two streams run one after the other here. With the split collapsed (each ``BackwardInput`` a
    ``Backward``, no ``BackwardWeight``) this is the compute order of DeepSpeed 0.19.8's
    ``DualPipeVSchedule``, which keeps weight gradients inside the backward (tests compare them). Raises
    ValueError if ``num_microbatches < 2 * num_stages`` (DeepSpeed's and the reference's requirement).
    """
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least 2 x num_stages = {2 * p} micro-batches, got {m}: raise "
                         f"gradient_accumulation_steps to {2 * p} or more, or use zb_v")
    orders: dict[int, list[Action]] = {}
    for r in range(p):
        stage = (r, 2 * p - 1 - r)
        fwd, bwd, queue, order = [0, 0], [0, 0], [], []

        def f(phase: int) -> None:
            order.append(Forward(fwd[phase], stage[phase]))
            fwd[phase] += 1

        def b(phase: int, zb: bool = False) -> None:
            mb = bwd[phase]
            bwd[phase] += 1
            order.append((BackwardInput if zb else Backward)(mb, stage[phase]))
            if zb:
                queue.append(BackwardWeight(mb, stage[phase]))

        def w() -> None:
            order.append(queue.pop(0))

        for _ in range((p - r - 1) * 2):             # step 1: nF0
            f(0)
        for _ in range(r + 1):                         # step 2: nF0F1
            f(0)
            f(1)
        for _ in range(p - r - 1):                     # step 3: nB1W1F1
            b(1, zb=True)
            w()
            f(1)
        for _ in range(m - 2 * p + r + 1):             # step 4 (main): nF0B1F1B0
            f(0)
            b(1)
            f(1)
            b(0)
        for _ in range(p - r - 1):                     # step 5: nB1F1B0
            b(1)
            f(1)
            b(0)
        zb, half = False, (r + 1) // 2                 # step 6: nB1B0, the second half zero-bubble
        for i in range(r + 1):
            zb = zb or (i == half and r % 2 == 1)
            b(1, zb)
            zb = zb or (i == half and r % 2 == 0)
            b(0, zb)
        for _ in range(p - r - 1):                     # step 7: nWB0
            w()
            b(0, zb=True)
        for _ in range(r + 1):                         # step 8: nW
            w()
        if queue:  # the reference asserts the same
            raise AssertionError(f"dualpipev: rank {r} left {len(queue)} weight-gradient passes unscheduled")
        orders[r] = order
    return with_communication(orders, 2 * p)


def candidate_schedules(num_stages: int, num_microbatches: int, *,
                        chunks: int = 2) -> dict[str, Callable[[], Schedule]]:
    """The implemented schedules that apply to these sizes, by name, as zero-argument builders.

    ``interleaved_1f1b`` is included only when ``num_stages > 1`` and ``num_microbatches`` is a
    multiple of ``num_stages`` (with ``chunks`` chunks per rank); ``zb_v`` always (two chunks);
    ``dualpipev`` when ``num_microbatches >= 2 * num_stages``.
    """
    _check_sizes(num_stages, num_microbatches, chunks)
    out: dict[str, Callable[[], Schedule]] = {
        "gpipe": lambda: gpipe(num_stages, num_microbatches),
        "1f1b": lambda: one_f_one_b(num_stages, num_microbatches),
        "zb_h1": lambda: zb_h1(num_stages, num_microbatches),
    }
    if num_stages > 1 and chunks > 1 and num_microbatches % num_stages == 0:
        out["interleaved_1f1b"] = lambda: interleaved_1f1b(num_stages, num_microbatches, chunks)
    out["zb_v"] = lambda: zb_v(num_stages, num_microbatches)
    if num_microbatches >= 2 * num_stages:
        out["dualpipev"] = lambda: dualpipev(num_stages, num_microbatches)
    return out


#: schedule name -> the model-stage layout it runs on: "one" chunk per rank, "interleaved" (chunks >= 2,
#: stage c * p + r on rank r) or "v" (two chunks, stages r and 2p - 1 - r); see partition.chunk_stages.
SCHEDULE_LAYOUTS = {"1f1b": "one", "gpipe": "one", "zb_h1": "one", "interleaved_1f1b": "interleaved", "zb_v": "v",
                    "dualpipev": "v"}


def build_schedule(name: str, num_stages: int, num_microbatches: int, *, chunks: int = 1,
                   layout: str = "interleaved") -> Schedule:
    """The schedule `name` (a key of SCHEDULE_LAYOUTS) for `num_stages` pipeline ranks holding `chunks` model
    chunks each in `layout` (`PipelineModule(chunks=..., chunk_layout=...)`).

    Raises ValueError naming the fix for an unknown name, a module whose chunks do not fit the schedule
    (1F1B, GPipe and ZB-H1 need one chunk per rank; interleaved 1F1B chunks >= 2 with the "interleaved"
    layout; ZB-V two chunks with the "v" layout), or sizes the schedule does not take.
    """
    if name not in SCHEDULE_LAYOUTS:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULE_LAYOUTS)}")
    want = SCHEDULE_LAYOUTS[name]
    have = "one" if chunks == 1 else layout
    if want != have or (want == "v" and chunks != 2):
        need = {"one": "chunks=1", "interleaved": "chunks >= 2 and chunk_layout='interleaved'",
                "v": "chunks=2 and chunk_layout='v'"}[want]
        raise ValueError(f"pipeline schedule {name!r} runs on a PipelineModule built with {need}, but this one has "
                         f"chunks={chunks}, chunk_layout={layout!r}: build the module with {need}, or choose a "
                         f"schedule for its layout ({', '.join(n for n, w in SCHEDULE_LAYOUTS.items() if w == have)})")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(num_stages, num_microbatches, chunks)
    return {"1f1b": one_f_one_b, "gpipe": gpipe, "zb_h1": zb_h1, "zb_v": zb_v,
            "dualpipev": dualpipev}[name](num_stages, num_microbatches)
