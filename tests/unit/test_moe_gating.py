"""zerospeed.moe gating: hand-computed routing (capacity, dropped tokens, expert counts, the auxiliary
loss), and bit-for-bit parity with DeepSpeed 0.19.8's gating functions and TopKGate (same logits, same
seed) over a grid of k, capacity factors, min_capacity, dropping, RTS, noise, used_token, sparse routes."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from zerospeed.moe.routing import expert_capacity, gumbel_rsample, multiplicative_jitter
from zerospeed.moe.sharded_moe import TopKGate, top1gating, top2gating, topkgating


def _routes(combine):
    """combine_weights [S, E, C] -> {token: {(expert, slot): weight}} of the nonzero entries."""
    out: dict[int, dict[tuple[int, int], float]] = {}
    for s, e, c in combine.nonzero().tolist():
        out.setdefault(s, {})[(e, c)] = combine[s, e, c].item()
    return out


# ---------------------------------------------------------------- hand-computed, no DeepSpeed needed

@pytest.mark.parametrize("tokens,experts,factor,min_capacity,expected", [
    (10, 4, 1.0, 0, 3),      # ceil(2.5)
    (10, 4, 1.25, 0, 4),     # ceil(3.125)
    (10, 4, 1.0, 8, 8),      # floored at min_capacity
    (10, 4, 2.0, 0, 5),      # k=2 x capacity_factor 1.0
    (12, 4, 3.0, 0, 9),      # k=3: exact product, no rounding up
    (25, 2, 1.2, 0, 16),     # DeepSpeed's float32 product rounds 15.0 up to 15.000001 -> 16 (exact: 15)
])
def test_capacity(tokens, experts, factor, min_capacity, expected):
    assert expert_capacity(tokens, experts, factor, min_capacity) == expected


def test_capacity_reaches_the_combine_weights():
    logits = torch.randn(10, 4)
    assert top1gating(logits, 1.0, 0)[1].shape == (10, 4, 3)
    assert top2gating(logits, 1.0, 0)[1].shape == (10, 4, 5)
    assert topkgating(logits, 3, 1.25, 0)[1].shape == (10, 4, 10)   # ceil(2.5 * 3.75) = 10
    assert top1gating(logits, 1.0, 6)[1].shape == (10, 4, 6)


def _skewed_top1_logits():
    """8 tokens, 2 experts: tokens 0-6 prefer expert 0, token 7 expert 1."""
    logits = torch.zeros(8, 2)
    logits[:7, 0] = torch.linspace(1.0, 2.0, 7)
    logits[7, 1] = 1.5
    return logits


def test_top1_random_token_selection_keeps_the_largest_draws():
    logits = _skewed_top1_logits()
    torch.manual_seed(3)
    l_aux, combine, dispatch, counts = top1gating(logits, 1.0, 0, use_rts=True)
    torch.manual_seed(3)
    draws = torch.rand(8, 2)[:7, 0]                      # the RTS priorities of expert 0's tokens
    kept0 = sorted(torch.topk(draws, 4).indices.tolist())  # capacity ceil(8/2) = 4
    gates = torch.softmax(logits, dim=1)
    expected = {s: {(0, slot): gates[s, 0].item()} for slot, s in enumerate(kept0)}
    expected[7] = {(1, 0): gates[7, 1].item()}
    assert _routes(combine) == expected
    assert torch.equal(dispatch, combine.bool())
    assert counts.tolist() == [7, 1] and counts.dtype == torch.int64
    # Switch eq. 4: E * sum_e f_e P_e, f = fraction of tokens routed (before dropping), P = mean probability
    assert l_aux.item() == pytest.approx(2 * (7 / 8 * gates[:, 0].mean() + 1 / 8 * gates[:, 1].mean()).item())


def test_top1_without_rts_keeps_capacity_tokens_and_dropless_keeps_all():
    logits = _skewed_top1_logits()
    _, combine, _, counts = top1gating(logits, 1.0, 0, use_rts=False)
    routes = _routes(combine)
    # which 4 of expert 0's 7 tokens stay is torch.topk's choice among equal priorities (DeepSpeed's rule)
    assert sum(1 for s in routes if s < 7) == 4 and 7 in routes and counts.tolist() == [7, 1]
    assert sorted(c for r in routes.values() for (e, c) in r if e == 0) == [0, 1, 2, 3]
    _, combine, _, counts = top1gating(logits, 1.0, 0, drop_tokens=False)
    assert combine.shape == (8, 2, 7) and sorted(_routes(combine)) == list(range(8))


def test_top1_used_token_routes_unused_tokens_nowhere():
    logits = _skewed_top1_logits()
    used = torch.tensor([1, 0, 1, 0, 1, 1, 1, 0])
    _, combine, _, counts = top1gating(logits, 2.0, 0, used_token=used)   # capacity 8: nothing dropped
    assert counts.tolist() == [5, 0]
    assert sorted(_routes(combine)) == [0, 2, 4, 5, 6]


def _top2_logits():
    """6 tokens, 3 experts: tokens 0-4 choose expert 0 then 1; token 5 chooses expert 1 then 2."""
    logits = torch.tensor([[3.0, 2.0, 0.0]] * 5 + [[0.0, 3.0, 2.0]])
    logits[:5, 0] += torch.arange(5) * 0.1
    return logits


def test_top2_drops_by_position_second_choices_after_all_first_choices():
    logits = _top2_logits()
    l_aux, combine, _, counts = top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False)
    # capacity ceil(6/3 * 2 * 0.5) = 2. Expert 0: first choices of tokens 0-4 at slots 0-4 -> 0, 1 kept.
    # Expert 1: token 5's first choice at slot 0, then the second choices of tokens 0-4 at slots 1-5 ->
    # only token 0's. Expert 2: token 5's second choice at slot 0.
    gates = torch.softmax(logits, dim=1)
    g = gates.tolist()
    norm0 = g[0][0] + g[0][1]
    expected = {0: {(0, 0): g[0][0] / norm0, (1, 1): g[0][1] / norm0},
                1: {(0, 1): 1.0},                                    # its 2nd route dropped: renormalised
                5: {(1, 0): g[5][1] / (g[5][1] + g[5][2]), (2, 0): g[5][2] / (g[5][1] + g[5][2])}}
    got = _routes(combine)
    assert got.keys() == expected.keys()
    for s, r in expected.items():
        assert got[s].keys() == r.keys() and all(got[s][key] == pytest.approx(w) for key, w in r.items())
    assert counts.tolist() == [5, 6, 1]
    # GShard's loss: E^2 * mean_e(f_e P_e), f from the first choices
    f = torch.tensor([5 / 6, 1 / 6, 0.0])
    assert l_aux.item() == pytest.approx((9 * (f * gates.mean(0)).mean()).item())


def test_topk_drop_policies():
    # 4 tokens, 2 experts, k=2 (every token to both), capacity ceil(4/2 * 2 * 0.25) = 1
    logits = torch.tensor([[0.5, 0.0], [2.0, 0.0], [-1.0, 0.0], [1.0, 0.0]])
    _, combine, _, counts = topkgating(logits, 2, 0.25, 0, drop_policy="probs")
    assert _routes(combine) == {1: {(0, 0): 1.0}, 2: {(1, 0): 1.0}}   # each expert's most probable token
    _, combine, _, _ = topkgating(logits, 2, 0.25, 0, drop_policy="position")
    gates = torch.softmax(logits, dim=1)[0]
    assert _routes(combine) == {0: {(0, 0): gates[0].item(), (1, 0): gates[1].item()}}   # the first token
    assert counts.tolist() == [4, 4]


def test_aux_loss_formulas_agree_across_k():
    torch.manual_seed(0)
    logits = torch.randn(64, 8)
    gates = torch.softmax(logits, dim=1)
    first = torch.nn.functional.one_hot(gates.argmax(1), 8).float()
    switch = 8 * (gates.mean(0) * first.mean(0)).sum()
    for loss in (top1gating(logits, 1.0, 0, use_rts=False)[0], top2gating(logits, 1.0, 0)[0],
                 topkgating(logits, 1, 1.0, 0)[0]):
        assert loss.item() == pytest.approx(switch.item(), rel=1e-6)
    top3 = torch.zeros_like(gates).scatter_(1, gates.topk(3, dim=1).indices, 1.0)
    want = 8 / 3 * (gates.mean(0) * top3.mean(0)).sum()
    assert topkgating(logits, 3, 1.0, 0)[0].item() == pytest.approx(want.item())


def test_dense_and_sparse_outputs_describe_the_same_routes():
    torch.manual_seed(1)
    logits = torch.randn(24, 4) + torch.tensor([2.0, 0.0, 0.0, -1.0])
    for fn in (lambda sp: top1gating(logits, 1.0, 2, sparse_routes=sp),
               lambda sp: top2gating(logits, 1.0, 2, sparse_routes=sp),
               lambda sp: topkgating(logits, 3, 1.0, 2, sparse_routes=sp)):
        torch.manual_seed(2)
        l_aux, combine, _, counts = fn(False)
        torch.manual_seed(2)
        l_aux2, capacity, experts, idx, loc, gates, counts2 = fn(True)
        assert experts == 4 and int(capacity) == combine.shape[2] and torch.equal(l_aux, l_aux2)
        assert torch.equal(counts, counts2) and idx.dtype == loc.dtype == torch.int32
        rebuilt = torch.zeros_like(combine)
        for r in range(idx.shape[0]):
            for s in range(idx.shape[1]):
                if idx[r, s] >= 0:
                    rebuilt[s, idx[r, s], loc[r, s]] = gates[r, s]
        assert torch.equal(rebuilt, combine) and bool((idx < 0).any())   # some routes dropped


def test_top2_leaves_the_logits_unchanged():
    logits = torch.randn(8, 4)
    before = logits.clone()
    top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=True)
    assert torch.equal(logits, before)


def test_noise_draws_equal_torch_distributions():
    """The property that makes seeded RSample / jitter / 2nd-expert sampling equal DeepSpeed's draws."""
    torch.manual_seed(7)
    want = torch.distributions.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample((50, 6))
    torch.manual_seed(7)
    assert torch.equal(gumbel_rsample((50, 6), torch.device("cpu")), want)
    x = torch.randn(50, 6)
    torch.manual_seed(7)
    want = x * torch.distributions.Uniform(torch.tensor(0.99), torch.tensor(1.01)).rsample(x.shape)
    torch.manual_seed(7)
    assert torch.equal(multiplicative_jitter(x, torch.device("cpu")), want)


def test_gate_module():
    gate = TopKGate(6, 4, k=2, capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=0)
    assert gate.wg.weight.dtype == torch.float32 and gate.wg.bias is None and gate.min_capacity == 0
    assert TopKGate(6, 4).min_capacity == 8
    x = torch.randn(12, 6, dtype=torch.bfloat16)
    assert gate(x)[1].shape == (12, 4, 6) and gate(x)[1].dtype == torch.float32
    gate.eval()
    assert gate(x)[1].shape == (12, 4, 12)   # eval_capacity_factor


@pytest.mark.parametrize("call,match", [
    (lambda: topkgating(torch.randn(8, 3), 4, 1.0, 0), "k=4 routes per token with 3 experts"),
    (lambda: topkgating(torch.randn(8, 3), 2, 1.0, 0, drop_policy="random"), "drop_policy='random'"),
    (lambda: top1gating(torch.randn(8, 3), 1.0, 0, used_token=torch.ones(7)), "used_token has 7 elements"),
    (lambda: TopKGate(8, 3, k=4), "k=4 routes per token but there are 3 experts"),
    (lambda: TopKGate(8, 3, k=0), "use 1 <= k <= num_experts"),
    (lambda: TopKGate(8, 3, noisy_gate_policy="jitter"), "noisy_gate_policy='jitter'"),
    (lambda: TopKGate(8, 3, capacity_factor=0), "must be > 0"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_rsample_with_k2_warns():
    with pytest.warns(UserWarning, match="only affects k=1"):
        TopKGate(8, 4, k=2, noisy_gate_policy="RSample")


# ---------------------------------------------------------------- bit-for-bit against DeepSpeed

@pytest.fixture(scope="module")
def ds():
    return pytest.importorskip("deepspeed.moe.sharded_moe")


def _logits(tokens=40, experts=4, seed=0):
    """Imbalanced logits (so capacity drops tokens) with duplicate rows (ties for torch.topk)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) + torch.linspace(1.0, -1.0, experts)
    logits[6] = logits[7] = logits[5]
    return logits


def _same(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f"{what}: output {i}"
        else:
            assert x == y, f"{what}: output {i}"


def _both(ds_fn, our_fn, logits, seed, *args):
    torch.manual_seed(seed)
    theirs = ds_fn(logits.clone(), *args)   # DeepSpeed's top2gating adds its noise to the logits in place
    torch.manual_seed(seed)
    ours = our_fn(logits.clone(), *args)
    return theirs, ours


def test_capacity_equals_deepspeeds(ds):
    grid = itertools.product(range(1, 80, 3), (2, 3, 5, 8), (0.3, 1.0, 1.2, 1.25, 2.5), (0, 4))
    for tokens, experts, factor, min_capacity in grid:
        want = int(ds._capacity(torch.empty(tokens, experts), torch.tensor(factor), torch.tensor(min_capacity)))
        assert expert_capacity(tokens, experts, factor, min_capacity) == want, (tokens, experts, factor)


def test_top1_equals_deepspeed(ds):
    logits = _logits()
    used = (torch.arange(40) % 3 != 0).long()
    grid = itertools.product([1.0, 1.25], [0, 12], [True, False], [True, False], [None, "RSample"], [None, used],
                             [False, True])
    dropped = 0
    for case in grid:
        cf, min_capacity, drop, rts, noisy, used_token, sparse = case
        theirs, ours = _both(ds.top1gating, top1gating, logits, 11, cf, min_capacity, used_token, noisy, drop, rts,
                             None, sparse)
        _same(theirs, ours, f"top1 {case}")
        if not sparse:
            dropped += int((ours[1].sum((1, 2)) == 0).sum())
    assert dropped > 0


def test_top2_equals_deepspeed(ds):
    logits = _logits()
    for case in itertools.product([1.0, 1.25], [0, 4, 24], [True, False], [True, False], [False, True]):
        cf, min_capacity, drop, sampling, sparse = case
        theirs, ours = _both(ds.top2gating, top2gating, logits, 12, cf, min_capacity, drop, None, sampling, sparse)
        _same(theirs, ours, f"top2 {case}")


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_topk_equals_deepspeed(ds, k):
    logits = _logits(experts=6)
    for case in itertools.product([1.0, 1.25], [0, 4], [True, False], ["probs", "position"], [False, True]):
        cf, min_capacity, drop, policy, sparse = case
        theirs, ours = _both(ds.topkgating, topkgating, logits, 13, k, cf, min_capacity, drop, None, policy, sparse)
        _same(theirs, ours, f"top{k} {case}")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gate_module_equals_deepspeed(ds, k):
    x = torch.randn(32, 10)
    used = (torch.arange(32) % 4 != 1).long()
    for noisy, training, sparse in itertools.product([None, "Jitter", "RSample"], [True, False], [False, True]):
        kwargs = dict(k=k, capacity_factor=1.0, eval_capacity_factor=1.25, min_capacity=4, noisy_gate_policy=noisy)
        with pytest.warns(UserWarning) if (noisy == "RSample" and k > 1) else _no_warning():
            ours = TopKGate(10, 5, **kwargs).train(training)
        theirs = ds.TopKGate(10, 5, **kwargs).train(training)
        theirs.load_state_dict(ours.state_dict())
        used_token = used if k == 1 else None   # DeepSpeed ignores used_token for k >= 2
        for seed in (0, 1):
            torch.manual_seed(seed)
            want = theirs(x, used_token, sparse)
            torch.manual_seed(seed)
            _same(want, ours(x, used_token, sparse), f"k={k} {noisy} training={training} sparse={sparse}")


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_fixture_logits_drop_tokens():
    """The parity grids above exercise dropping: at capacity factor 1 some tokens lose routes."""
    _, combine, _, counts = top2gating(_logits(), 1.0, 0, top2_2nd_expert_sampling=False)
    assert int(counts.max()) > math.ceil(40 / 4 * 2) and bool((combine.sum((1, 2)) < 1 - 1e-6).any())
