"""zerospeed.moe.layer.MoE, Experts and moe.utils: hand-computed layer outputs, parameter marking and
optimizer groups, clear errors for bad input, and parity with DeepSpeed 0.19.8's MoE (same weights and
seed -> bit-identical output, l_aux, exp_counts and gradients; the same losses over a few SGD steps)."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from zerospeed.moe.experts import Experts
from zerospeed.moe.layer import MoE
from zerospeed.moe.utils import (configure_moe_param_groups, has_moe_layers, is_moe_param, is_moe_param_group,
                                 split_params_grads_into_shared_and_expert_params,
                                 split_params_into_different_moe_groups_for_optimizer,
                                 split_params_into_shared_and_expert_params)

M = 8


def _mlp():
    return nn.Sequential(nn.Linear(M, 2 * M), nn.GELU(), nn.Linear(2 * M, M))


class _Scale(nn.Module):
    """x -> x * factor, with (output, bias) returned as Megatron's experts do."""

    def __init__(self):
        super().__init__()
        self.factor = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.factor, None


# ---------------------------------------------------------------- hand-computed

def test_top1_layer_output_by_hand():
    moe = MoE(M, _Scale(), num_experts=2, k=1, capacity_factor=1.0, min_capacity=0, use_rts=False)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    with torch.no_grad():
        experts[0].factor.fill_(2.0)
        experts[1].factor.fill_(-3.0)
        moe.deepspeed_moe.gate.wg.weight.zero_()
        moe.deepspeed_moe.gate.wg.weight[1, 0] = 1.0   # logit of expert 1 = x[0]; expert 0's is 0
    x = torch.randn(2, 3, M)
    x[..., 0] = torch.tensor([[1.0, 2.0, -1.0], [-2.0, 0.5, -0.5]])   # tokens 0, 1, 4 -> expert 1; others -> 0
    out, l_aux, counts = moe(x)
    assert counts.tolist() == [3, 3]                    # capacity ceil(6/2) = 3: nothing dropped
    p1 = torch.sigmoid(x[..., 0])                       # softmax([0, x0])[1]
    chosen = x[..., 0] > 0
    factor = torch.where(chosen, -3.0, 2.0)
    weight = torch.where(chosen, p1, 1 - p1)
    torch.testing.assert_close(out, x * (factor * weight).unsqueeze(-1))
    assert l_aux.item() == pytest.approx(2 * (0.5 * (1 - p1).mean() + 0.5 * p1.mean()).item())

    x[..., 0] = torch.tensor([[1.0, 2.0, -1.0], [3.0, 0.5, 1.5]])    # 5 tokens -> expert 1, capacity 3
    out, _, counts = moe(x)
    assert counts.tolist() == [1, 5]
    dropped = (out.abs().sum(-1) == 0)
    assert int(dropped.sum()) == 2 and not bool(dropped[0, 2])       # 2 of expert 1's tokens get zero output


def test_residual_mixes_dense_and_moe_outputs():
    torch.manual_seed(0)
    moe = MoE(M, _mlp(), num_experts=4, k=2, use_residual=True)
    x = torch.randn(4, M)
    out, _, _ = moe(x)
    coef = torch.softmax(moe.coefficient(x), dim=-1)
    torch.testing.assert_close(out, moe.deepspeed_moe(x, None) * coef[:, :1] + moe.mlp(x) * coef[:, 1:])


def test_parameters_and_state_dict():
    expert = _mlp()
    moe = MoE(M, expert, num_experts=4, use_residual=True)
    assert moe.mlp is expert and moe.num_local_experts == 4 and moe.expert_group_name == "ep_size_1"
    expert_params = list(moe.deepspeed_moe.experts.parameters())
    assert len(expert_params) == 16 and all(p.allreduce is False and p.group_name == "ep_size_1" for p in expert_params)
    assert all(is_moe_param(p) for p in expert_params)
    assert not any(is_moe_param(p) for p in [*moe.mlp.parameters(), *moe.coefficient.parameters(),
                                             moe.deepspeed_moe.gate.wg.weight])
    copies = moe.deepspeed_moe.experts.deepspeed_experts
    assert copies[0][0].weight is not copies[1][0].weight and torch.equal(copies[0][0].weight, copies[1][0].weight)
    keys = list(moe.state_dict())
    assert keys[0] == "deepspeed_moe.gate.wg.weight" and "deepspeed_moe.experts.deepspeed_experts.3.2.bias" in keys
    assert keys[-2:] == ["coefficient.weight", "coefficient.bias"]
    assert has_moe_layers(nn.Sequential(nn.Linear(M, M), moe)) == (True, 4)
    assert has_moe_layers(nn.Linear(M, M)) == (False, 0)


def test_used_token_and_eval_capacity():
    torch.manual_seed(0)
    moe = MoE(M, _mlp(), num_experts=2, k=2, capacity_factor=0.5, eval_capacity_factor=4.0, min_capacity=0)
    x = torch.randn(2, 5, M)
    used = torch.ones(2, 5)
    used[1, 3:] = 0
    out, _, counts = moe(x, used)
    assert counts.tolist() == [8, 8] and out[1, 3:].abs().sum() == 0
    moe.eval()
    out, _, _ = moe(x)
    assert bool((out.abs().sum(-1) > 0).all())          # capacity 4 x 10 x 2 / 2: nothing dropped


def test_batch_smaller_than_min_capacity_routes():
    # DeepSpeed's top-1 asserts tokens >= min_capacity (e.g. one token at a time in generation)
    moe = MoE(M, _mlp(), num_experts=4, k=1, min_capacity=4).eval()
    out, _, counts = moe(torch.randn(1, 1, M))
    assert out.shape == (1, 1, M) and int(counts.sum()) == 1 and bool(out.abs().sum() > 0)


@pytest.mark.parametrize("build,error,match", [
    (lambda: MoE(M, _mlp(), num_experts=6, ep_size=4), ValueError, "num_experts=6 is not divisible by ep_size=4.*"
     "num_experts=4 or 8"),
    (lambda: MoE(M, _mlp(), num_experts=4, ep_size=2)(torch.randn(8, M)), RuntimeError,
     "ep_size=2 but no expert-parallel process group yet: build the engine with zerospeed.initialize"),
    (lambda: MoE(M, _mlp(), num_experts=2, k=3), ValueError, "k=3 routes per token but there are 2 experts"),
    (lambda: MoE(M, _mlp(), num_experts=2, k=0), ValueError, "use 1 <= k <= num_experts"),
    (lambda: MoE(M, _mlp(), num_experts=2, noisy_gate_policy="Gumbel"), ValueError, "'Jitter'"),
])
def test_bad_construction(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_bad_forward():
    moe = MoE(M, nn.Linear(M, 2 * M), num_experts=2)
    with pytest.raises(ValueError, match=r"expert 0 \(Linear\) returned shape \(8, 16\) for an input of shape \(8, 8\)"):
        moe(torch.randn(16, M))
    moe.deepspeed_moe.packed = False  # the padded layout checks its [ep, L, C, M] buffer
    with pytest.raises(ValueError, match=r"returned shape \(1, 1, 8, 16\) for an input of shape \(1, 1, 8, 8\)"):
        moe(torch.randn(16, M))
    moe = MoE(M, _mlp(), num_experts=2)
    with pytest.raises(ValueError, match="last dimension must be hidden_size"):
        moe(torch.randn(16, M + 1))
    with pytest.raises(ValueError, match="used_token has 15 elements"):
        moe(torch.randn(16, M), torch.ones(15))
    with pytest.raises(ValueError, match="num_local_experts=2"):
        moe.deepspeed_moe.experts(torch.randn(1, 3, 4, M))


def test_tutel_and_expert_tensor_parallelism_are_accepted():
    torch.manual_seed(0)
    plain = MoE(M, _mlp(), num_experts=4)
    torch.manual_seed(0)
    other = MoE(M, _mlp(), num_experts=4, use_tutel=True, enable_expert_tensor_parallelism=True)
    x = torch.randn(16, M)
    torch.manual_seed(1)
    want = plain(x)[0]
    torch.manual_seed(1)
    assert torch.equal(other(x)[0], want)
    other.set_deepspeed_parallelism()


# ---------------------------------------------------------------- moe.utils

def _marked(n, group_name="ep_size_1"):
    params = [nn.Parameter(torch.zeros(n)) for _ in range(3)]
    for p in params:
        p.allreduce, p.group_name = False, group_name
    return params


def test_split_param_groups():
    dense = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2))]
    experts = _marked(5)
    groups = [{"params": iter([dense[0], *experts[:2]]), "lr": 0.1, "name": "a"},   # a generator works
              {"params": [dense[1], experts[2]], "lr": 0.2}]                        # no "name" needed
    out = split_params_into_different_moe_groups_for_optimizer(groups, max_group_size=10)
    assert [g["params"] for g in out[:2]] == [[dense[0]], [dense[1]]] and not is_moe_param_group(out[0])
    assert [(g["name"], g["lr"], g["moe"], g["params"]) for g in out[2:]] == [
        ("ep_size_1", 0.1, True, experts[:2]), ("ep_size_1", 0.2, True, experts[2:])]
    out = split_params_into_different_moe_groups_for_optimizer({"params": experts, "name": "x"}, max_group_size=9)
    assert [g["params"] for g in out] == [[], experts[:1], experts[1:2], experts[2:]]   # 5 + 5 > 9
    assert [g["params"] for g in out[1:]] == [g["params"] for g in out[1:] if is_moe_param_group(g)]
    out = configure_moe_param_groups([dense[0], experts[0]])
    assert [(g["name"], g["params"]) for g in out] == [("dense-params", [dense[0]]), ("ep_size_1", [experts[0]])]
    assert configure_moe_param_groups(out) is out
    experts[0].grad = torch.ones(5)
    dense[0].grad = torch.ones(4)
    assert [len(x) for x in split_params_grads_into_shared_and_expert_params([*dense, *experts])] == [1, 1]
    assert split_params_into_shared_and_expert_params([*dense, experts[1]]) == (dense, [experts[1]])


def test_split_param_groups_like_deepspeed():
    ds_utils = pytest.importorskip("deepspeed.moe.utils")
    dense = [nn.Parameter(torch.zeros(4)) for _ in range(2)]
    experts = _marked(5) + _marked(7, "ep_size_2")[:1]
    groups = [{"params": [dense[0], *experts[:2]], "lr": 0.1, "name": "a"},
              {"params": [dense[1], *experts[2:]], "lr": 0.2, "weight_decay": 0.0, "name": "b"}]
    for size in (None, 5, 12, 10 ** 9):
        want = ds_utils.split_params_into_different_moe_groups_for_optimizer([dict(g) for g in groups], size)
        got = split_params_into_different_moe_groups_for_optimizer(groups, size)
        key = lambda g: (g["name"], g.get("moe", False), g["lr"], [id(p) for p in g["params"]])  # noqa: E731
        want = [key(g) for g in want if g["params"] or not g.get("moe")]   # DeepSpeed may add empty moe groups
        assert sorted(map(key, got)) == sorted(want), size


# ---------------------------------------------------------------- bit-for-bit against DeepSpeed

@pytest.fixture(scope="module")
def ds_moe():
    return pytest.importorskip("deepspeed.moe.layer").MoE


def _pair(ds_moe, **kwargs):
    torch.manual_seed(0)
    theirs = ds_moe(M, _mlp(), num_experts=4, **kwargs)
    ours = MoE(M, _mlp(), num_experts=4, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _run(moe, x, used, seed):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out, l_aux, counts = moe(x, used)
    (out.float().square().sum() + l_aux).backward()
    grads = [p.grad for p in moe.parameters()]
    return [out, l_aux, counts, x.grad, *grads]


def test_seeded_construction_draws_deepspeeds_weights(ds_moe):
    for k, residual in itertools.product([1, 2], [False, True]):
        torch.manual_seed(3)
        theirs = ds_moe(M, _mlp(), num_experts=4, k=k, use_residual=residual).state_dict()
        torch.manual_seed(3)
        ours = MoE(M, _mlp(), num_experts=4, k=k, use_residual=residual).state_dict()
        assert list(theirs) == list(ours) and all(torch.equal(theirs[n], ours[n]) for n in theirs)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("residual", [False, True])
def test_layer_equals_deepspeed(ds_moe, k, residual):
    x = torch.randn(3, 12, M)
    used = (torch.arange(36) % 5 != 2).long() if k == 1 else None   # DeepSpeed ignores used_token for k >= 2
    cases = [dict(), dict(noisy_gate_policy="Jitter"), dict(drop_tokens=False),
             dict(capacity_factor=1.25, use_rts=False)]
    if k == 1:
        cases.append(dict(noisy_gate_policy="RSample", min_capacity=12))
    for seed, (kwargs, training) in enumerate(itertools.product(cases, [True, False])):
        theirs, ours = _pair(ds_moe, k=k, use_residual=residual, **kwargs)
        theirs.train(training)
        ours.train(training)
        want, got = _run(theirs, x, used, seed), _run(ours, x, used, seed)
        for i, (a, b) in enumerate(zip(want, got)):  # packed: the experts run on unpadded rows, same values
            assert a.dtype == b.dtype, f"{kwargs} training={training}: output {i}"
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{kwargs} training={training}: {i}")
        ours.deepspeed_moe.packed = False  # DeepSpeed's padded layout, kept as an option: bit for bit
        ours.zero_grad(set_to_none=True)
        got = _run(ours, x, used, seed)
        for i, (a, b) in enumerate(zip(want, got)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{kwargs} training={training}: padded {i}"


def test_layer_equals_deepspeed_in_bf16(ds_moe):
    theirs, ours = _pair(ds_moe, k=2)
    theirs.bfloat16()
    ours.bfloat16()
    x = torch.randn(2, 16, M, dtype=torch.bfloat16)
    for a, b in zip(_run(theirs, x, None, 0), _run(ours, x, None, 0)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_training_steps_equal_deepspeed(ds_moe):
    theirs, ours = _pair(ds_moe, k=2, use_residual=True)
    data = torch.randn(4, 2, 10, M)
    losses = []
    for model in (theirs, ours):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(9)
        run = []
        for x in data:
            out, l_aux, _ = model(x)
            loss = (out - x).square().mean() + 0.01 * l_aux
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == losses[1]
