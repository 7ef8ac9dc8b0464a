"""LR schedules: sequences against closed forms of DeepSpeed's formulas, resume, param groups.

Every sequence is [lr written at construction (iteration -1)] + [lr after each of N step() calls
(iterations 0..N-1)], checked to a relative 1e-12 against a closed form written here
independently of the implementation.
"""
from __future__ import annotations

import math

import pytest
import torch

from zerospeed.optim import (
    SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

N_STEPS = 30


def _opt(kind="adam", lrs=(0.5,)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lrs[0])
    return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)


def _run(sched, opt, n=N_STEPS, key="lr"):
    seq = [[g[key] for g in opt.param_groups]]
    for _ in range(n):
        sched.step()
        seq.append([g[key] for g in opt.param_groups])
    return seq


def _assert_seq(actual, expected):
    assert len(actual) == len(expected)
    for t, (a_row, e_row) in enumerate(zip(actual, expected), start=-1):
        for a, e in zip(a_row, e_row):
            assert math.isclose(a, e, rel_tol=1e-12, abs_tol=1e-15), (t, a, e)


# ---------------------------------------------------------------- closed forms (DeepSpeed 0.19.8)
def warm_frac(t, w, kind):
    w = max(2, w)
    return math.log(t + 1) / math.log(w) if kind == "log" else t / w


def warmup_lr(t, lo, hi, w, kind):
    if t < 0:
        return lo
    if t < max(2, w):
        return lo + (hi - lo) * warm_frac(t, w, kind)
    return hi


def warmup_decay_lr(t, lo, hi, w, total, kind):
    w2 = max(2, w)
    if t < 0:
        return lo
    if t < w2:
        return lo + (hi - lo) * warm_frac(t, w, kind)
    return lo + (hi - lo) * max(0.0, (total - t) / max(1, total - w2))


def warmup_cosine_lr(t, base, wmin, w, cmin, total, kind):
    w2 = max(2, w)
    if t < 0:
        return 0.0
    if t < w2:
        return base * (wmin + (1 - wmin) * warm_frac(t, w, kind))
    p = min(1.0, (t - w2 + 1) / max(1, total - w2))
    return base * max(0.0, cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * p)))


def range_test_lr(t, lo, size, rate, stair):
    k = (t + 1) // size if stair else (t + 1) / size
    return lo * (1 + rate * k)


def one_cycle_scale(t, s1, s2, k1, k2):
    n = s1 + s2
    c = (t + 1) % n
    if c <= s1:
        return math.floor(c * k1 / s1) / k1 if k1 else c / s1
    return math.floor((n - c) * k2 / s2) / k2 if k2 else (n - c) / s2


def one_cycle(t, lo, hi, mlo, mhi, s1, s2, k1=0, k2=0, dstep=0, dlr=0.0, dmom=0.0):
    """(lr, betas[0]) of iteration t."""
    n = s1 + s2
    if t < n:
        s = one_cycle_scale(t, s1, s2, k1, k2)
        return lo + (hi - lo) * s, mhi - (mhi - mlo) * s
    d = t - n + 1
    lr = lo if (dstep == 0 or dlr == 0) else lo / (1 + dlr * d / dstep)
    mom = mhi if (dstep == 0 or dmom == 0) else mhi * (1 + dmom * d / dstep)
    return lr, mom


TS = range(-1, N_STEPS)


# ------------------------------------------------------------------------------------ warm-up
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_sequence(kind):
    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type=kind)
    _assert_seq(_run(sched, opt), [[warmup_lr(t, 0.01, 0.1, 10, kind)] for t in TS])
    assert sched.get_last_lr() == [0.1]


def test_warmup_lr_defaults_log_and_max_from_group_lrs():
    opt = _opt(lrs=(0.2, 0.05))
    sched = WarmupLR(opt, warmup_num_steps=12)
    assert sched.warmup_type == "log"
    expected = [[warmup_lr(t, 0.0, hi, 12, "log") for hi in (0.2, 0.05)] for t in TS]
    _assert_seq(_run(sched, opt), expected)


def test_warmup_lr_constructor_writes_min_and_first_two_steps_share_it():
    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=0.03, warmup_max_lr=0.3, warmup_num_steps=5)
    assert opt.param_groups[0]["lr"] == 0.03 and sched.get_last_lr() == [0.03]
    sched.step()
    assert sched.last_batch_iteration == 0 and opt.param_groups[0]["lr"] == 0.03


def test_warmup_num_steps_one_is_raised_to_two():
    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert sched.warmup_num_steps == 2
    _assert_seq(_run(sched, opt, 4), [[0.0], [0.0], [0.5], [1.0], [1.0]])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_sequence(kind):
    opt = _opt(lrs=(0.5, 0.25))
    sched = WarmupDecayLR(
        opt, total_num_steps=25, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.2],
        warmup_num_steps=8, warmup_type=kind,
    )
    expected = [
        [warmup_decay_lr(t, lo, hi, 8, 25, kind) for lo, hi in ((0.0, 0.1), (0.01, 0.2))] for t in TS
    ]
    seq = _run(sched, opt)
    _assert_seq(seq, expected)
    assert seq[-1] == [0.0, 0.01]  # past total_num_steps: back at min_lr, not below


def test_warmup_decay_default_max_is_0_001_not_group_lr():
    opt = _opt(lrs=(0.5,))
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_num_steps=4)
    _assert_seq(_run(sched, opt), [[warmup_decay_lr(t, 0.0, 0.001, 4, 20, "log")] for t in TS])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_sequence(kind):
    opt = _opt(lrs=(0.4, 0.1))
    sched = WarmupCosineLR(
        opt, total_num_steps=24, warmup_min_ratio=0.1, warmup_num_steps=6, cos_min_ratio=0.05,
        warmup_type=kind,
    )
    expected = [[warmup_cosine_lr(t, base, 0.1, 6, 0.05, 24, kind) for base in (0.4, 0.1)] for t in TS]
    seq = _run(sched, opt)
    _assert_seq(seq, expected)
    assert seq[0] == [0.0, 0.0]  # DeepSpeed writes lr 0 at construction
    assert seq[-1] == pytest.approx([0.4 * 0.05, 0.1 * 0.05], rel=1e-12)  # clamped at the floor
    assert sched.get_lr_ratio() == pytest.approx(0.05, rel=1e-12)


def test_warmup_cosine_total_not_above_warmup_stays_at_floor():
    opt = _opt(lrs=(1.0,))
    sched = WarmupCosineLR(opt, total_num_steps=3, warmup_num_steps=5, warmup_type="linear")
    expected = [[warmup_cosine_lr(t, 1.0, 0.0, 5, 1e-4, 3, "linear")] for t in TS]
    _assert_seq(_run(sched, opt), expected)


# ------------------------------------------------------------------------------ range test
@pytest.mark.parametrize("stair", [False, True])
def test_lr_range_test_sequence(stair):
    opt = _opt(lrs=(0.5, 0.5))
    sched = LRRangeTest(
        opt, lr_range_test_min_lr=[1e-3, 2e-3], lr_range_test_step_size=4,
        lr_range_test_step_rate=0.5, lr_range_test_staircase=stair,
    )
    expected = [[range_test_lr(t, lo, 4, 0.5, stair) for lo in (1e-3, 2e-3)] for t in TS]
    seq = _run(sched, opt)
    _assert_seq(seq, expected)
    if stair:
        assert seq[1] == seq[2] == seq[3] == [1e-3, 2e-3] and seq[4] != seq[3]


# ------------------------------------------------------------------------------- one cycle
ONE_CYCLE_CASES = {
    "asymmetric+decay": dict(s1=6, s2=4, dstep=3, dlr=0.5, dmom=0.1),
    "symmetric-default-second": dict(s1=5, s2=None, dstep=2, dlr=1.0, dmom=0.0),
    "stairs": dict(s1=9, s2=6, k1=3, k2=2, dstep=4, dlr=0.25, dmom=0.05),
    "no-decay": dict(s1=7, s2=3),
    "zero-second-half": dict(s1=8, s2=0, dstep=1, dlr=0.1),
}


@pytest.mark.parametrize("case", list(ONE_CYCLE_CASES))
def test_one_cycle_lr_and_momentum(case):
    c = dict(ONE_CYCLE_CASES[case])
    s1, s2 = c.pop("s1"), c.pop("s2")
    k1, k2 = c.pop("k1", 0), c.pop("k2", None)
    dstep, dlr, dmom = c.pop("dstep", 0), c.pop("dlr", 0.0), c.pop("dmom", 0.0)
    opt = _opt("adam", lrs=(0.5, 0.5))
    lo, hi, mlo, mhi = [1e-4, 2e-4], [1e-2, 5e-2], [0.8, 0.85], [0.9, 0.95]
    sched = OneCycle(
        opt, cycle_min_lr=lo, cycle_max_lr=hi, decay_lr_rate=dlr, cycle_first_step_size=s1,
        cycle_second_step_size=s2, cycle_first_stair_count=k1, cycle_second_stair_count=k2,
        decay_step_size=dstep, cycle_min_mom=mlo, cycle_max_mom=mhi, decay_mom_rate=dmom,
    )
    s2v = s1 if s2 is None else s2
    k2v = k1 if k2 is None else k2
    lrs, moms = [[g["lr"] for g in opt.param_groups]], [[g["betas"] for g in opt.param_groups]]
    for _ in range(N_STEPS):
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
        moms.append([g["betas"] for g in opt.param_groups])
    exp = [[one_cycle(t, lo[i], hi[i], mlo[i], mhi[i], s1, s2v, k1, k2v, dstep, dlr, dmom)
            for i in range(2)] for t in range(N_STEPS)]
    # construction writes cycle_min_lr and (cycle_min_mom, 0.99)
    assert lrs[0] == lo and moms[0] == [(0.8, 0.99), (0.85, 0.99)]
    _assert_seq(lrs[1:], [[e[0] for e in row] for row in exp])
    _assert_seq([[b[0] for b in row] for row in moms[1:]], [[e[1] for e in row] for row in exp])
    assert all(b[1] == 0.99 for row in moms for b in row)
    assert [m[0] for m in sched.get_mom()] == [b[0] for b in moms[-1]]
    if s2v > 0:  # the peak is reached exactly at the end of the first half
        assert lrs[s1] == pytest.approx(hi, rel=1e-12)
    else:  # no falling half: the cycle wraps back to the minimum instead of reaching the peak
        assert lrs[s1] == lo


def test_one_cycle_with_sgd_does_not_cycle_momentum():
    opt = _opt("sgd")
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)
    assert sched.cycle_momentum is False and sched.get_mom() is None
    seq = _run(sched, opt)
    assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9
    _assert_seq(seq[1:], [[one_cycle(t, 0.01, 0.1, 0, 0, 4, 4)[0]] for t in range(N_STEPS)])


# ------------------------------------------------------------------- stepping and resuming
def _factories():
    return {
        "WarmupLR": lambda o, **kw: WarmupLR(o, 0.01, 0.1, 10, "linear", **kw),
        "WarmupDecayLR": lambda o, **kw: WarmupDecayLR(o, 25, 0.0, 0.1, 8, **kw),
        "WarmupCosineLR": lambda o, **kw: WarmupCosineLR(o, 24, 0.1, 6, 0.05, **kw),
        "LRRangeTest": lambda o, **kw: LRRangeTest(o, 1e-3, 4, 0.5, True, **kw),
        "OneCycle": lambda o, **kw: OneCycle(o, 1e-4, 1e-2, 0.5, 6, 4, decay_step_size=3,
                                             decay_mom_rate=0.1, **kw),
    }


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_state_dict_round_trip_resumes_sequence(name):
    make = _factories()[name]
    opt_a = _opt(lrs=(0.3, 0.6))
    a = make(opt_a)
    full = _run(a, opt_a)

    opt_b = _opt(lrs=(0.3, 0.6))
    b = make(opt_b)
    _run(b, opt_b, 12)
    sd = b.state_dict()
    assert sd == {"last_batch_iteration": 11}

    # resume: fresh optimizer (as before training) and schedule, then load the counter
    opt_c = _opt(lrs=(0.3, 0.6))
    c = make(opt_c)
    c.load_state_dict(sd)
    assert c.last_batch_iteration == 11
    resumed = _run(c, opt_c, N_STEPS - 12)
    _assert_seq(resumed[1:], full[13:])
    if name == "OneCycle":
        assert opt_c.param_groups[0]["betas"] == opt_a.param_groups[0]["betas"]


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_built_mid_run_leaves_optimizer_alone_and_steps_on(name):
    make = _factories()[name]
    opt_a = _opt(lrs=(0.3, 0.6))
    full = _run(make(opt_a), opt_a)
    opt = _opt(lrs=(0.3, 0.6))
    sched = make(opt, last_batch_iteration=9)
    assert [g["lr"] for g in opt.param_groups] == [0.3, 0.6]
    with pytest.raises(RuntimeError, match="step"):
        sched.get_last_lr()
    _assert_seq(_run(sched, opt, 5)[1:], full[11:16])


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_step_to_explicit_iteration(name):
    make = _factories()[name]
    opt_a = _opt()
    full = _run(make(opt_a), opt_a)
    opt = _opt()
    sched = make(opt)
    sched.step(17)
    assert sched.last_batch_iteration == 17
    _assert_seq([[g["lr"] for g in opt.param_groups]], [full[18]])
    assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]


def test_tensor_lr_is_filled_in_place():
    p = torch.nn.Parameter(torch.zeros(2))
    lr = torch.tensor(0.1)
    opt = torch.optim.SGD([p], lr=lr, foreach=False)
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.0
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(0.1 * 0.5)


def test_wrapper_with_inner_optimizer_is_unwrapped():
    opt = _opt()

    class Wrapper:
        optimizer = opt

    sched = WarmupLR(Wrapper(), warmup_min_lr=0.02, warmup_max_lr=0.2, warmup_num_steps=3)
    assert sched.optimizer is opt and opt.param_groups[0]["lr"] == 0.02
    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())


# ------------------------------------------------------------------------------- validation
def test_invalid_arguments_raise_with_the_value():
    opt = _opt(lrs=(0.1, 0.2))
    with pytest.raises(ValueError, match="warmup_type.*'cosine'"):
        WarmupLR(opt, warmup_type="cosine")
    with pytest.raises(ValueError, match="warmup_num_steps.*0"):
        WarmupDecayLR(opt, 100, warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_num_steps.*10.0"):
        WarmupCosineLR(opt, 100, warmup_num_steps=10.0)
    with pytest.raises(ValueError, match="3 values.*2 param groups"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="lr_range_test_step_size"):
        LRRangeTest(opt, lr_range_test_step_size=0)
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(opt, 0.1, 1.0, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="cycle_second_step_size"):
        OneCycle(opt, 0.1, 1.0, cycle_second_step_size=-1)


# ---------------------------------------------------------------------------- build_scheduler
def test_build_scheduler_from_config_block():
    opt = _opt()
    sched = build_scheduler(
        opt, "WarmupDecayLR",
        {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 100, "total_num_steps": 1000},
    )
    assert isinstance(sched, WarmupDecayLR) and sched.total_num_steps == 1000
    assert set(SCHEDULERS) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}
    assert isinstance(build_scheduler(_opt(), "WarmupLR", None), WarmupLR)


def test_build_scheduler_falls_back_to_torch_lr_scheduler():
    opt = _opt(lrs=(1.0,))
    sched = build_scheduler(opt, "StepLR", {"step_size": 2, "gamma": 0.5})
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)


def test_build_scheduler_errors():
    opt = _opt()
    with pytest.raises(ValueError, match=r"unknown scheduler type 'WarmupLr'.*'WarmupLR'.*WarmupCosineLR"):
        build_scheduler(opt, "WarmupLr", {})
    with pytest.raises(ValueError, match=r"'warmup_max'.*Did you mean 'warmup_max_lr'"):
        build_scheduler(opt, "WarmupLR", {"warmup_max": 0.1})
    with pytest.raises(ValueError, match=r"needs parameter\(s\) total_num_steps"):
        build_scheduler(opt, "WarmupCosineLR", {"warmup_num_steps": 10})
    with pytest.raises(ValueError, match=r"cycle_min_lr, cycle_max_lr"):
        build_scheduler(opt, "OneCycle", {})


# ------------------------------------------------------------- cross-check against DeepSpeed
def _ds_cases():
    return [
        ("WarmupLR", dict(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10)),
        ("WarmupLR", dict(warmup_min_lr=[0.01, 0.0], warmup_num_steps=7, warmup_type="linear")),
        ("WarmupDecayLR", dict(total_num_steps=25, warmup_max_lr=0.1, warmup_num_steps=8)),
        ("WarmupDecayLR", dict(total_num_steps=20, warmup_min_lr=0.02, warmup_num_steps=1,
                               warmup_type="linear")),
        ("WarmupCosineLR", dict(total_num_steps=24, warmup_min_ratio=0.1, warmup_num_steps=6,
                                cos_min_ratio=0.05)),
        ("WarmupCosineLR", dict(total_num_steps=4, warmup_num_steps=6, warmup_type="linear")),
        ("LRRangeTest", dict(lr_range_test_min_lr=1e-3, lr_range_test_step_size=4,
                             lr_range_test_step_rate=0.5)),
        ("LRRangeTest", dict(lr_range_test_min_lr=[1e-3, 3e-3], lr_range_test_step_size=3,
                             lr_range_test_staircase=True)),
        ("OneCycle", dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, decay_lr_rate=0.5, cycle_first_step_size=6,
                          cycle_second_step_size=4, decay_step_size=3, decay_mom_rate=0.1)),
        ("OneCycle", dict(cycle_min_lr=[1e-4, 1e-3], cycle_max_lr=[1e-2, 2e-2], cycle_first_step_size=9,
                          cycle_second_step_size=6, cycle_first_stair_count=3, cycle_second_stair_count=2,
                          decay_step_size=4, decay_lr_rate=0.25)),
        ("OneCycle", dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=5,
                          cycle_first_stair_count=2)),
    ]


@pytest.mark.parametrize("name,params", _ds_cases())
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_matches_deepspeed_exactly(name, params, kind):
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    ours_opt, ds_opt = _opt(kind, lrs=(0.3, 0.6)), _opt(kind, lrs=(0.3, 0.6))
    ours = build_scheduler(ours_opt, name, params)
    theirs = getattr(lr_schedules, name)(ds_opt, **params)
    for t in range(-1, 40):
        if t >= 0:
            ours.step()
            theirs.step()
        assert [g["lr"] for g in ours_opt.param_groups] == [g["lr"] for g in ds_opt.param_groups], t
        assert [g.get("betas") for g in ours_opt.param_groups] == [g.get("betas") for g in ds_opt.param_groups]
        assert ours.get_lr() == theirs.get_lr()
        assert ours.state_dict() == theirs.state_dict()
    if name == "OneCycle":
        assert ours.get_mom() == theirs.get_mom()
