"""Pipeline schedules as data: generators, validator and simulator (one process, no tensors).

Checks each schedule against the published formulas (1F1B and interleaved bubbles, ZB-H1's bubble,
peak in-flight activations) and 1F1B against DeepSpeed's own ``TrainSchedule`` (pure Python).
"""
from __future__ import annotations

import pytest

from types import SimpleNamespace

from zerospeed.pipe.schedule import (Backward, BackwardInput, BackwardWeight, Forward, LoadMicroBatch, OptimizerStep,
                                     RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad,
                                     candidate_schedules, dualpipev, fuse_adjacent_backwards, gpipe, interleaved_1f1b,
                                     one_f_one_b, zb_h1, zb_v)
from zerospeed.pipe.simulate import StageTimes, best_schedule, simulate, validate

SIZES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 7, 8)]


def _compute(schedule, rank):
    return [(type(a).__name__, a.microbatch, a.stage) for a in schedule[rank]
            if isinstance(a, (Forward, Backward, BackwardInput, BackwardWeight))]


@pytest.mark.parametrize("p,m", SIZES)
def test_one_f_one_b_matches_deepspeed_train_schedule(p, m):
    """Per stage, the forward/backward micro-batch sequence equals DeepSpeed's TrainSchedule's.

    Read two ways from deepspeed/runtime/pipe/schedule.py: the micro-batch ids of
    ``_step_to_micro_batch`` for the steps that compute, and the ForwardPass/BackwardPass buffer ids
    of ``steps()`` against ours mod ``num_pipe_buffers()``.
    """
    ds = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    ours = one_f_one_b(p, m)
    for s in range(p):
        sched = ds.TrainSchedule(micro_batches=m, stages=p, stage_id=s)
        ids = []
        for step in range(2 * (m + p - 1)):
            mb, fwd = sched._step_to_micro_batch(step)
            if 0 <= mb < m:
                ids.append(("F" if fwd else "B", mb))
        buffers = [("F" if isinstance(c, ds.ForwardPass) else "B", c.buffer_id)
                   for cmds in sched.steps() for c in cmds if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]
        mine = [("F" if k == "Forward" else "B", mb) for k, mb, _ in _compute(ours, s)]
        assert mine == ids, f"stage {s} of {p}, {m} micro-batches"
        assert [(k, mb % sched.num_pipe_buffers()) for k, mb in mine] == buffers
        tail = [type(a).__name__ for a in ours[s][-3:]]
        assert tail == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]


@pytest.mark.parametrize("p,m", SIZES)
def test_every_schedule_is_valid(p, m):
    for name, build in candidate_schedules(p, m, chunks=2).items():
        validate(build(), p, m, chunks=2 if name in ("interleaved_1f1b", "zb_v", "dualpipev") else 1)
    for v in (2, 3):
        if m % p == 0:
            validate(interleaved_1f1b(p, m, v), p, m, chunks=v)


def test_one_f_one_b_actions_in_full():
    """Two stages, two micro-batches: receives right before, sends right after, loads on both ends."""
    assert one_f_one_b(2, 2) == {
        0: [LoadMicroBatch(0, 0), Forward(0, 0), SendActivation(0, 0, 1),
            LoadMicroBatch(1, 0), Forward(1, 0), SendActivation(1, 0, 1),
            RecvGrad(0, 0, 1), Backward(0, 0), RecvGrad(1, 0, 1), Backward(1, 0),
            ReduceTiedGrads(), ReduceGrads(), OptimizerStep()],
        1: [RecvActivation(0, 1, 0), LoadMicroBatch(0, 1), Forward(0, 1), Backward(0, 1), SendGrad(0, 1, 0),
            RecvActivation(1, 1, 0), LoadMicroBatch(1, 1), Forward(1, 1), Backward(1, 1), SendGrad(1, 1, 0),
            ReduceTiedGrads(), ReduceGrads(), OptimizerStep()],
    }


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 8) for m in (1, 3, 4, 8, 16)])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (0.5, 0.75, 0.25)])
def test_one_f_one_b_bubble_formula(p, m, f, b, w):
    """Equal stage times, no latency: bubble (p - 1) / (m + p - 1), step (m + p - 1)(F + B + W)."""
    r = simulate(one_f_one_b(p, m), StageTimes(f, b, w))
    assert r.step_time == pytest.approx((m + p - 1) * (f + b + w), rel=1e-12)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=1e-12)
    assert r.per_rank_busy == pytest.approx([m * (f + b + w)] * p)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 3), (4, 8), (5, 7)])
def test_peak_activations(p, m):
    assert simulate(gpipe(p, m)).peak_activations_per_rank == (m,) * p
    assert simulate(one_f_one_b(p, m)).peak_activations_per_rank == tuple(min(p - r, m) for r in range(p))
    assert simulate(gpipe(p, m)).step_time == simulate(one_f_one_b(p, m)).step_time


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 5), (4, 4), (4, 8), (6, 12)])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0)])
def test_zb_h1_smaller_bubble_same_memory(p, m, f, b, w):
    """Qi et al. 2024 §3.1: ZB-H1's bubble is (p - 1)(T_F + T_B - T_W) against 1F1B's (p - 1)(T_F + T_B + T_W)."""
    times = StageTimes(f, b, w)
    zb, base = simulate(zb_h1(p, m), times), simulate(one_f_one_b(p, m), times)
    assert zb.bubble_fraction < base.bubble_fraction
    assert zb.peak_activations_per_rank == base.peak_activations_per_rank
    assert zb.step_time == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w), rel=1e-12)


def test_zb_h1_without_weight_time_is_one_f_one_b():
    times = StageTimes(1.0, 2.0, 0.0)
    assert simulate(zb_h1(4, 8), times) == simulate(one_f_one_b(4, 8), times)


def test_zb_h1_defers_rank_r_weight_passes():
    """Rank r holds r weight-gradient passes back: after its last B it still runs r + 1 W passes."""
    s = zb_h1(4, 8)
    for r in range(4):
        comp = _compute(s, r)
        tail = comp[len(comp) - r - 2:]
        assert [k for k, _, _ in tail] == ["BackwardInput"] + ["BackwardWeight"] * (r + 1)
        assert [mb for _, mb, _ in tail[1:]] == list(range(8 - r - 1, 8))


@pytest.mark.parametrize("p,k", [(2, 1), (2, 4), (3, 2), (4, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_formula(p, k, v):
    """Narayanan et al. 2021 §2.2: bubble (p - 1) / (v m + p - 1) with each chunk 1/v of a rank's time.

    The paper derives it for per-chunk times t/v and no communication cost, exactly what the
    simulator models at zero latency, and Megatron's order reaches it exactly for every size tried;
    the tolerance (1e-9) covers only float rounding. A latency makes the bubble larger.
    """
    m = p * k
    times = StageTimes(1.0, 1.5, 0.5)
    r = simulate(interleaved_1f1b(p, m, v), times)
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
    assert r.per_rank_busy == pytest.approx([m * 3.0] * p)
    assert r.bubble_fraction < simulate(one_f_one_b(p, m), times).bubble_fraction
    slow = simulate(interleaved_1f1b(p, m, v), StageTimes(1.0, 1.5, 0.5, send_latency=0.1))
    assert slow.bubble_fraction > r.bubble_fraction


def test_interleaved_layout_and_order():
    s = interleaved_1f1b(2, 4, 2)
    # model stage c * p + r on rank r
    assert {a.stage for a in s[0] if isinstance(a, Forward)} == {0, 2}
    assert {a.stage for a in s[1] if isinstance(a, Forward)} == {1, 3}
    # Megatron: micro-batches 0, 1 through chunk 0, then through chunk 1, then 2, 3 ...
    fwd0 = [(a.microbatch, a.stage) for a in s[0] if isinstance(a, Forward)]
    assert fwd0 == [(0, 0), (1, 0), (0, 2), (1, 2), (2, 0), (3, 0), (2, 2), (3, 2)]
    bwd0 = [(a.microbatch, a.stage) for a in s[0] if isinstance(a, Backward)]
    assert bwd0 == [(0, 2), (1, 2), (0, 0), (1, 0), (2, 2), (3, 2), (2, 0), (3, 0)]
    # stage 3 hands its gradient to stage 2 (rank 0); stage 1 -> 2 is a message too
    assert SendActivation(0, 1, 2) in s[1] and RecvGrad(0, 2, 3) in s[0]


def test_interleaved_rejects_uneven_microbatches():
    with pytest.raises(ValueError, match="multiple of num_stages: 6 micro-batches over 4 stages; use 8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        interleaved_1f1b(4, 8, 0)
    assert "interleaved_1f1b" not in candidate_schedules(4, 6)


def _replace(actions, old, new):
    out = list(actions)
    out[out.index(old)] = new
    return out


def _swap(actions, a, b):
    out = list(actions)
    i, j = out.index(a), out.index(b)
    out[i], out[j] = out[j], out[i]
    return out


def test_validate_backward_before_forward():
    s = one_f_one_b(1, 2)
    s[0] = _swap(s[0], Forward(1, 0), Backward(1, 0))
    with pytest.raises(ValueError, match=r"rank 0, action \d+ Backward\(microbatch=1, stage=0\): backward precedes "
                                         r"its forward"):
        validate(s, 1, 2)


def test_validate_weight_before_input_gradient():
    s = zb_h1(2, 3)
    s[1] = _swap(s[1], BackwardInput(0, 1), BackwardWeight(0, 1))
    with pytest.raises(ValueError, match=r"rank 1, .*BackwardWeight\(microbatch=0, stage=1\): weight-gradient pass "
                                         r"precedes its input-gradient pass"):
        validate(s, 2, 3)


def test_validate_forward_before_its_input_arrived():
    s = one_f_one_b(2, 2)
    s[1] = _swap(s[1], RecvActivation(1, 1, 0), Forward(1, 1))
    with pytest.raises(ValueError, match=r"rank 1, .*Forward\(microbatch=1, stage=1\): runs before its input is here"):
        validate(s, 2, 2)


def test_validate_missing_backward_and_forward():
    s = gpipe(2, 3)
    s[0] = [a for a in s[0] if a != Backward(2, 0)]
    with pytest.raises(ValueError, match="micro-batch 2 on model stage 0 .rank 0. misses its backward"):
        validate(s, 2, 3)
    s = zb_h1(2, 3)
    s[0] = [a for a in s[0] if a != BackwardWeight(1, 0)]
    with pytest.raises(ValueError, match="micro-batch 1 on model stage 0 .rank 0. misses its weight-gradient pass"):
        validate(s, 2, 3)
    with pytest.raises(ValueError, match="micro-batch 3 on model stage 0 .rank 0. misses its forward"):
        validate(gpipe(2, 3), 2, 4)


def test_validate_receives_out_of_send_order():
    s = gpipe(2, 2)
    s[1] = _swap(s[1], RecvActivation(0, 1, 0), RecvActivation(1, 1, 0))
    s[1] = _swap(s[1], Forward(0, 1), Forward(1, 1))
    s[1] = _swap(s[1], LoadMicroBatch(0, 1), LoadMicroBatch(1, 1))
    with pytest.raises(ValueError, match=r"rank 1, .*RecvActivation\(microbatch=1, stage=1, peer=0\): the next "
                                         r"message from rank 0 is \('activation', 0, 0, 1\)"):
        validate(s, 2, 2)


def test_validate_deadlock_names_the_waiting_ranks():
    """Each rank first waits for what the other sends only after its own receive: no one moves."""
    s = one_f_one_b(2, 1)
    s[0] = [RecvGrad(0, 0, 1), LoadMicroBatch(0, 0), Forward(0, 0), SendActivation(0, 0, 1), Backward(0, 0),
            OptimizerStep()]
    with pytest.raises(ValueError, match=r"deadlock: no rank can advance \(rank 0 waits at action 0 "
                                         r"RecvGrad\(microbatch=0, stage=0, peer=1\); rank 1 waits at action 0 "
                                         r"RecvActivation\(microbatch=0, stage=1, peer=0\)\)"):
        validate(s, 2, 1)


def test_validate_missing_message_bad_peer_and_late_step():
    s = gpipe(2, 1)
    s[1] = [a for a in s[1] if a != SendGrad(0, 1, 0)]
    s[0] = [a for a in s[0] if a != RecvGrad(0, 0, 1)]
    with pytest.raises(ValueError, match=r"rank 0, .*Backward\(microbatch=0, stage=0\): runs before its output "
                                         r"gradient is here: put RecvGrad\(microbatch=0, stage=0, peer=1\) before it"):
        validate(s, 2, 1)
    s = gpipe(2, 1)
    s[0] = _replace(s[0], SendActivation(0, 0, 1), SendActivation(0, 0, 0))
    with pytest.raises(ValueError, match="peer must be the neighbouring model stage 1"):
        validate(s, 2, 1)
    s = gpipe(2, 1)
    s[0] = [RecvActivation(0, 0, -1)] + s[0]
    with pytest.raises(ValueError, match="model stage 0 has no neighbour -1 to exchange this with"):
        validate(s, 2, 1)
    s = gpipe(2, 1)
    s[0] = s[0] + [LoadMicroBatch(0, 1)]
    with pytest.raises(ValueError, match="model stage 1 is computed on rank 1, not here"):
        validate(s, 2, 1)
    s = gpipe(2, 1)
    s[0] = s[0] + [SendActivation(0, 0, 1)]
    with pytest.raises(ValueError, match="appears twice on this rank"):
        validate(s, 2, 1)
    s = gpipe(2, 2)
    s[0].remove(OptimizerStep())
    s[0].insert(s[0].index(Backward(1, 0)), OptimizerStep())
    with pytest.raises(ValueError, match=r"Backward\(microbatch=1, stage=0\): runs after OptimizerStep"):
        validate(s, 2, 2)
    s = gpipe(2, 1)
    s[0] = _swap(s[0], Forward(0, 0), SendActivation(0, 0, 1))
    with pytest.raises(ValueError, match=r"sends an activation before Forward\(0, 0\) produced it"):
        validate(s, 2, 1)


def test_validate_shape_errors():
    with pytest.raises(ValueError, match=r"ranks 0..2; got ranks \[0, 1\]"):
        validate(gpipe(2, 2), 3, 2)
    with pytest.raises(ValueError, match=r"2 ranks x 2 chunks make model stages 0..3, but stages \[2, 3\] have no "
                                         r"computation"):
        validate(gpipe(2, 2), 2, 2, chunks=2)
    s = gpipe(2, 1)
    s[1] = s[1] + [Forward(0, 0)]
    with pytest.raises(ValueError, match="computes model stage 0, which rank 0 computes too"):
        validate(s, 2, 1)
    s = gpipe(2, 1)
    s[0] = s[0] + ["step"]
    with pytest.raises(ValueError, match="is not an action of zerospeed.pipe.actions"):
        validate(s, 2, 1)
    with pytest.raises(ValueError, match="num_microbatches must be a positive int, got 0"):
        one_f_one_b(2, 0)


def test_stage_times_per_stage_and_errors():
    slow_last = StageTimes(forward=[1.0, 1.0, 2.0], backward_input=[1.0, 1.0, 2.0], backward_weight=0.0)
    r = simulate(one_f_one_b(3, 4), slow_last)
    assert r.per_rank_busy == (8.0, 8.0, 16.0)
    assert r.step_time >= 16.0 + 2 * 2.0  # the slow stage runs every micro-batch, plus the fill and drain
    with pytest.raises(ValueError, match="StageTimes.forward has 2 entries but the schedule has 3 pipeline stages"):
        simulate(one_f_one_b(3, 4), StageTimes(forward=[1.0, 1.0]))
    with pytest.raises(ValueError, match="StageTimes.backward_weight is negative on stage 0"):
        simulate(one_f_one_b(3, 4), StageTimes(backward_weight=-1.0))
    assert simulate(one_f_one_b(3, 4), StageTimes(send_latency=0.5)).step_time > simulate(one_f_one_b(3, 4)).step_time


def test_send_overhead_costs_the_sender():
    # 2 ranks, 1 micro-batch: F0, send (0.25), F1, B1, send grad (0.25), B0; the sends add to the step, not the busy time
    r = simulate(one_f_one_b(2, 1), StageTimes(1.0, 1.0, 0.0, send_latency=0.5, send_overhead=0.25))
    assert r.step_time == pytest.approx(1 + 0.25 + 0.5 + 1 + 1 + 0.25 + 0.5 + 1)
    assert r.per_rank_busy == (2.0, 2.0)
    assert r.bubble_fraction == pytest.approx(1 - 4 / (2 * r.step_time))
    # a rank that sends every micro-batch pays m overheads: 1F1B p 2 m 8 grows by >= 8 of them
    base = simulate(one_f_one_b(2, 8), StageTimes(1.0, 1.0, 0.0)).step_time
    assert simulate(one_f_one_b(2, 8), StageTimes(1.0, 1.0, 0.0, send_overhead=0.1)).step_time >= base + 8 * 0.1 - 1e-9
    with pytest.raises(ValueError, match="StageTimes.send_overhead is -1"):
        simulate(one_f_one_b(2, 1), StageTimes(send_overhead=-1.0))


def test_pass_overhead_is_busy_time_per_computation():
    # 2 ranks, 1 micro-batch, fused backward: 4 computations on the critical path, each 0.5 longer
    r = simulate(one_f_one_b(2, 1), StageTimes(1.0, 1.0, 0.0, pass_overhead=0.5))
    assert r.step_time == pytest.approx(4 * 1.5) and r.per_rank_busy == (3.0, 3.0)
    # two chunks per rank pay it twice per micro-batch: they lose their edge when passes are short
    assert best_schedule(2, 4, StageTimes(1.0, 1.0, 0.0))[0] in ("interleaved_1f1b", "zb_v")  # 9 against 10
    assert best_schedule(2, 4, StageTimes(1.0, 1.0, 0.0, pass_overhead=0.4))[0] == "1f1b"  # 14 against 16.2


def test_best_schedule():
    times = StageTimes(1.0, 1.0, 1.0)
    name, r = best_schedule(4, 8, times)
    assert name == "zb_v" and r == simulate(zb_v(4, 8), times)
    # a message costs 2 forwards: the 1F1B family waits a round trip per steady-state micro-batch,
    # GPipe streams its forwards (45 s against ZB-H1's 57 s) at the cost of m activations per rank
    assert best_schedule(4, 8, StageTimes(1.0, 1.0, 1.0, send_latency=2.0))[0] == "gpipe"
    # no weight-gradient time to defer: interleaving shrinks the bubble instead
    assert best_schedule(4, 8, StageTimes(1.0, 2.0, 0.0))[0] == "interleaved_1f1b"
    assert best_schedule(1, 3)[0] == "1f1b"  # one rank: all tie, the lowest peak memory wins


def _torch_order(cls, p, m, chunks):
    """Compute order of a torch.distributed.pipelining schedule class, without processes.

    Calls its ``_calculate_single_rank_operations(rank)`` (private, pure Python in torch 2.13) on a
    namespace carrying the attributes its ``__init__`` would set from the stages.
    """
    kinds = {"FORWARD": Forward, "BACKWARD_INPUT": BackwardInput, "BACKWARD_WEIGHT": BackwardWeight,
             "FULL_BACKWARD": Backward}
    rounds = max(1, m // p)
    ns = SimpleNamespace(pp_group_size=p, n_local_stages=chunks, _n_microbatches=m, num_stages=p * chunks,
                         number_of_rounds=rounds, microbatches_per_round=m // rounds)
    return {r: [kinds[a.computation_type.name](a.microbatch_index, a.stage_index)
                for a in cls._calculate_single_rank_operations(ns, r) if a is not None] for r in range(p)}


@pytest.mark.parametrize("p,m", [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8, 12)])
def test_orders_match_torch_pipelining(p, m):
    """interleaved_1f1b, zb_h1 and zb_v give torch 2.13's Interleaved1F1B, InterleavedZeroBubble
    (one chunk) and ZBVZeroBubble compute orders."""
    T = pytest.importorskip("torch.distributed.pipelining.schedules")

    def ours(s):
        return {r: [a for a in acts if isinstance(a, (Forward, Backward, BackwardInput, BackwardWeight))]
                for r, acts in s.items()}
    assert ours(zb_v(p, m)) == _torch_order(T.ScheduleZBVZeroBubble, p, m, 2)
    assert ours(zb_h1(p, m)) == _torch_order(T.ScheduleInterleavedZeroBubble, p, m, 1)
    if m % p == 0:
        for v in (2, 3):
            assert ours(interleaved_1f1b(p, m, v)) == _torch_order(T.ScheduleInterleaved1F1B, p, m, v)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_zb_v_bubble_and_memory(p, k):
    """Qi et al. 2024 §6. With T_F = T_B = T_W per chunk and m >= 2p, the only idle time is the
    start-up, (p - 1) chunk forwards: step = m (F + B + W) + (p - 1) F / 2; every rank peaks at 2p
    (micro-batch, chunk) pairs = p stages' activations, 1F1B's first-stage peak."""
    m = p * k
    times = StageTimes(1.0, 1.0, 1.0)
    r = simulate(zb_v(p, m), times)
    assert r.step_time == pytest.approx(m * 3.0 + (p - 1) * 0.5, rel=1e-12)
    assert r.step_time < simulate(zb_h1(p, m), times).step_time
    assert r.peak_activations_per_rank == (2 * p,) * p
    assert max(r.peak_activations_per_rank) / 2 == max(simulate(one_f_one_b(p, m), times).peak_activations_per_rank)


def test_zb_v_layout_and_receive_order():
    """Rank r holds stages r and 2p - 1 - r; stages p - 1 and p share a rank, so no message between
    them. Rank 0 sends micro-batch 2's activation before micro-batch 0's gradient, so rank 1 receives
    them in that order although it needs the gradient first."""
    s = zb_v(2, 4)
    assert {a.stage for a in s[0] if isinstance(a, Forward)} == {0, 3}
    assert {a.stage for a in s[1] if isinstance(a, Forward)} == {1, 2}
    assert not any(isinstance(a, (SendActivation, RecvActivation)) and {a.stage, a.peer} == {1, 2}
                   for acts in s.values() for a in acts)
    assert s[1].index(RecvActivation(2, 1, 0)) < s[1].index(RecvGrad(0, 2, 3)) < s[1].index(BackwardInput(0, 2))
    assert s[1].index(Forward(2, 1)) > s[1].index(BackwardInput(0, 2))


@pytest.mark.parametrize("name,build,fused", [("zb_v", zb_v, (8, 7)), ("zb_h1", zb_h1, (8, 0)),
                                               ("dualpipev", dualpipev, (2, 0))])
def test_fuse_adjacent_backwards_changes_no_timing(name, build, fused):
    """A B immediately followed by its own W (no message between) becomes one Backward: the count per rank is
    the one the docstring states (p 2, m 8), the fused schedule is still valid, and with a Backward costing
    B + W every rank's timeline is unchanged (only a cheaper fused backward changes it)."""
    plan = build(2, 8)
    out = {r: fuse_adjacent_backwards(acts) for r, acts in plan.items()}
    assert tuple(sum(isinstance(a, Backward) for a in out[r]) - sum(isinstance(a, Backward) for a in plan[r])
                 for r in (0, 1)) == fused
    for r in (0, 1):
        assert len(out[r]) == len(plan[r]) - fused[r]
        assert not any(isinstance(a, BackwardInput) and Backward(a.microbatch, a.stage) in out[r] for a in out[r])
    chunks = 1 if name == "zb_h1" else 2
    validate(out, 2, 8, chunks=chunks)
    times = StageTimes(1.0, [1.2, 0.9], [0.7, 1.1], send_latency=0.05)
    got, want = simulate(out, times), simulate(plan, times)
    assert got.step_time == pytest.approx(want.step_time, rel=1e-12)
    assert got.per_rank_busy == pytest.approx(want.per_rank_busy, rel=1e-12)
    assert got.peak_activations_per_rank == want.peak_activations_per_rank


def test_build_schedule_matches_the_generators_and_checks_the_module_layout():
    from zerospeed.pipe.partition import chunk_stages, stage_rank
    from zerospeed.pipe.schedule import build_schedule, gpipe, interleaved_1f1b, one_f_one_b, stage_owners, zb_h1, zb_v

    assert build_schedule("1f1b", 3, 6) == one_f_one_b(3, 6) and build_schedule("gpipe", 3, 6) == gpipe(3, 6)
    assert build_schedule("zb_h1", 3, 6) == zb_h1(3, 6)
    assert build_schedule("interleaved_1f1b", 2, 4, chunks=3) == interleaved_1f1b(2, 4, 3)
    assert build_schedule("zb_v", 2, 4, chunks=2, layout="v") == zb_v(2, 4)
    for name, chunks, layout in [("interleaved_1f1b", 3, "interleaved"), ("zb_v", 2, "v"), ("1f1b", 1, "v")]:
        owners = stage_owners(build_schedule(name, 3, 6, chunks=chunks, layout=layout))
        assert owners == {s: stage_rank(s, 3, chunks, layout) for s in range(3 * chunks)}
        for r in range(3):
            assert chunk_stages(r, 3, chunks, layout) == sorted(s for s, o in owners.items() if o == r)
    with pytest.raises(ValueError, match="chunks=2 and chunk_layout='v'.*choose a schedule for its layout"):
        build_schedule("zb_v", 2, 4, chunks=2)
    with pytest.raises(ValueError, match="needs num_microbatches a multiple of num_stages"):
        build_schedule("interleaved_1f1b", 2, 3, chunks=2)
    with pytest.raises(ValueError, match="chunks=1"):
        build_schedule("zb_h1", 2, 4, chunks=2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("dualpipe", 2, 4)


DUALPIPE_SIZES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (2 * p, 2 * p + 1, 3 * p, 12)]


@pytest.mark.parametrize("p,m", DUALPIPE_SIZES)
def test_dualpipev_matches_deepspeed_with_the_split_collapsed(p, m):
    """DualPipeV: valid; every weight-gradient pass follows its input-gradient pass; with each BackwardInput read
    as a fused backward (and the BackwardWeights dropped) the per-rank compute order is DeepSpeed 0.19.8's
    DualPipeVSchedule ((micro-batch, phase) of its ForwardPass / BackwardPass, buffer = phase x m + mb)."""
    from zerospeed.pipe.schedule import dualpipev

    ours = dualpipev(p, m)
    validate(ours, p, m, chunks=2)
    for r in range(p):
        comp = _compute(ours, r)
        assert sum(k == "BackwardWeight" for k, _, _ in comp) == sum(k == "BackwardInput" for k, _, _ in comp)
    ds = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for r in range(p):
        sched = ds.DualPipeVSchedule(micro_batches=m, stages=p, stage_id=r)
        theirs = [("F" if isinstance(c, ds.ForwardPass) else "B", c.buffer_id % m, c.buffer_id // m)
                  for cmds in sched.steps() for c in cmds if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]
        mine = [("F" if k == "Forward" else "B", mb, 0 if stage == r else 1)
                for k, mb, stage in _compute(ours, r) if k != "BackwardWeight"]
        assert mine == theirs, (p, m, r)


def test_dualpipev_needs_two_micro_batches_per_stage():
    from zerospeed.pipe.schedule import dualpipev

    with pytest.raises(ValueError, match="at least 2 x num_stages = 6 micro-batches, got 5"):
        dualpipev(3, 5)


def test_pipe_schedule_cli_prints_every_schedule_and_the_best(capsys):
    from zerospeed.cli import main

    assert main(["pipe-schedule", "--stages", "4", "--microbatches", "8", "--forward", "1",
                 "--backward-input", "1", "--backward-weight", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip().replace(" (best)", ""): line for line in out.splitlines()
            if line.startswith("| ") and "schedule" not in line and "---" not in line}
    assert sorted(rows) == sorted(["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zb_v", "dualpipev"])
    assert "| 33 | 27.3% |" in rows["1f1b"]  # (p - 1) / (m + p - 1) = 3 / 11 with T_F = T_B = T_W
    best, result = best_schedule(4, 8, StageTimes(1.0, 1.0, 1.0))
    assert f'"pipeline": {{"schedule": "{best}"}}' in out and "(best)" in rows[best]
    assert main(["pipe-schedule", "--stages", "2", "--microbatches", "4", "--forward", "1,2,3"]) == 2
    assert "--forward takes one time >= 0 or 2 comma-separated ones" in capsys.readouterr().out
