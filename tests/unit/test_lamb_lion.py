"""Lion (Chen et al. 2023, Algorithm 1) and Lamb (You et al. 2020, Algorithm 2) against hand-written
references of the papers' updates; their config blocks; DeepSpeed's `zerospeed.ops` names."""
from __future__ import annotations

import inspect
import math

import pytest
import torch

from zerospeed.config import ConfigError, load_config
from zerospeed.config.optimizer import OWN_OPTIMIZER_PARAMS, check_optimizer_for_stage
from zerospeed.optim import Lamb, Lion, build_optimizer

BASE = {"train_micro_batch_size_per_gpu": 2}
SHAPES = [(7, 5), (13,), (3, 4, 2)]


def _tensors(dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype) * scale for s in SHAPES]


def _grads(step, dtype):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]


def _run(opt_cls, params0, steps, **kw):
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = opt_cls(params, **kw)
    for t in range(steps):
        for p, g in zip(params, _grads(t, params0[0].dtype)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params], opt


# ---- Lion ------------------------------------------------------------------------------------------
def lion_reference(xs, steps, lr, betas, wd):
    """Algorithm 1 of Chen et al. 2023, written out."""
    b1, b2 = betas
    xs = [x.clone() for x in xs]
    ms = [torch.zeros_like(x) for x in xs]
    for t in range(steps):
        for i, g in enumerate(_grads(t, xs[0].dtype)):
            c = b1 * ms[i] + (1 - b1) * g
            xs[i] = xs[i] - lr * (torch.sign(c) + wd * xs[i])
            ms[i] = b2 * ms[i] + (1 - b2) * g
    return xs, ms


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lion_equals_algorithm_1(wd, dtype):
    x0 = _tensors(dtype)
    got, opt = _run(Lion, x0, 6, lr=0.01, betas=(0.9, 0.99), weight_decay=wd)
    ref, ref_m = lion_reference(x0, 6, 0.01, (0.9, 0.99), wd)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)  # the same roundings in the same order: bit-exact
    for p, m in zip(opt.param_groups[0]["params"], ref_m):
        assert torch.equal(opt.state[p]["exp_avg"], m)


def test_lion_defaults_are_deepspeeds_and_bad_values_raise():
    opt = Lion([torch.nn.Parameter(torch.zeros(2))])
    assert opt.defaults == {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}  # FusedLion's
    for kw, match in (({"lr": 0.0}, "lr must be > 0"), ({"betas": (0.9, 1.0)}, "betas"),
                      ({"weight_decay": -1.0}, "weight_decay")):
        with pytest.raises(ValueError, match=match):
            Lion([torch.nn.Parameter(torch.zeros(2))], **kw)


def test_lion_on_flat_slices_equals_lion_on_whole_tensors():
    """Elementwise: ZeRO's flat partition rows get the same numbers as the parameters."""
    x0 = _tensors(torch.float32)
    whole, _ = _run(Lion, x0, 4, lr=0.01, weight_decay=0.1)
    flat = torch.nn.Parameter(torch.cat([x.reshape(-1) for x in x0]))
    opt = Lion([flat], lr=0.01, weight_decay=0.1)
    for t in range(4):
        flat.grad = torch.cat([g.reshape(-1) for g in _grads(t, torch.float32)])
        opt.step()
    assert torch.equal(flat.detach(), torch.cat([w.reshape(-1) for w in whole]))


# ---- Lamb ------------------------------------------------------------------------------------------
def lamb_reference(xs, steps, lr, betas, eps, weight_decay, max_coeff=10.0, min_coeff=0.01, bias_correction=True,
                   eps_inside_sqrt=False):
    """Algorithm 2 of You et al. 2020, written out, with DeepSpeed's clamp of the trust ratio."""
    b1, b2 = betas
    xs = [x.clone() for x in xs]
    ms = [torch.zeros_like(x) for x in xs]
    vs = [torch.zeros_like(x) for x in xs]
    ratios = []
    for t in range(1, steps + 1):
        ratios = []
        for i, g in enumerate(_grads(t - 1, xs[0].dtype)):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1 ** t) if bias_correction else ms[i]
            v_hat = vs[i] / (1 - b2 ** t) if bias_correction else vs[i]
            r = m_hat / (torch.sqrt(v_hat + eps) if eps_inside_sqrt else torch.sqrt(v_hat) + eps)
            u = r + weight_decay * xs[i]
            x_norm, u_norm = math.sqrt(float((xs[i] ** 2).sum())), math.sqrt(float((u ** 2).sum()))
            ratio = min(max(x_norm / u_norm, min_coeff), max_coeff) if x_norm > 0 and u_norm > 0 else 1.0
            xs[i] = xs[i] - lr * ratio * u
            ratios.append(ratio)
    return xs, ratios


@pytest.mark.parametrize("kw", [
    {},
    {"weight_decay": 0.05},
    {"weight_decay": 0.01, "bias_correction": False},
    {"eps_inside_sqrt": True, "eps": 1e-6},
    {"max_coeff": 0.5, "min_coeff": 0.1},
])
def test_lamb_equals_algorithm_2(kw):
    args = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0) | kw
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        x0 = _tensors(dtype, scale=0.5)
        got, opt = _run(Lamb, x0, 5, **args)
        ref, ratios = lamb_reference(x0, 5, **args)
        for a, b in zip(got, ref):
            assert ((a - b).abs().max() / b.abs().max()).item() < tol, (dtype, kw)
        assert opt.get_lamb_coeffs() == pytest.approx(ratios, rel=tol)


def test_lamb_trust_ratio_is_clamped_and_one_for_zero_norms():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(100, generator=g, dtype=torch.float64) * 1e3   # ||x|| / ||u|| ~ 1e3 -> max_coeff 10
    tiny = torch.randn(100, generator=g, dtype=torch.float64) * 1e-5  # ~ 1e-5 -> min_coeff 0.01
    zero = torch.zeros(100, dtype=torch.float64)                        # ||x|| = 0 -> 1
    params = [torch.nn.Parameter(t.clone()) for t in (big, tiny, zero)]
    opt = Lamb(params, lr=0.1)
    grads = [torch.randn(100, generator=g, dtype=torch.float64) for _ in range(3)]
    for p, gr in zip(params, grads):
        p.grad = gr
    opt.step()
    assert opt.get_lamb_coeffs() == [10.0, 0.01, 1.0]
    for p, x, gr, ratio in zip(params, (big, tiny, zero), grads, (10.0, 0.01, 1.0)):
        u = gr / (gr.abs() + 1e-8)  # step 1 with bias correction: m_hat = g, v_hat = g^2
        torch.testing.assert_close(p.detach(), x - 0.1 * ratio * u, rtol=1e-12, atol=1e-15)


def test_lamb_defaults_are_fusedlambs_and_bad_values_raise():
    opt = Lamb([torch.nn.Parameter(torch.zeros(2))])
    assert opt.defaults == {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
                            "eps_inside_sqrt": False, "weight_decay": 0.0, "max_coeff": 10.0, "min_coeff": 0.01}
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(NotImplementedError, match="AMSGrad"):
        Lamb(p, amsgrad=True)
    with pytest.raises(NotImplementedError, match="gradient_clipping"):
        Lamb(p, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="min_coeff <= max_coeff"):
        Lamb(p, min_coeff=2.0, max_coeff=1.0)


# ---- config and factory ----------------------------------------------------------------------------
def _optimizer(section, **kw):
    return load_config({**BASE, "optimizer": section}, **kw).optimizer


def _error(section) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "optimizer": section})
    return str(info.value)


def test_config_builds_lamb_and_lion_with_deepspeed_params():
    lamb = _optimizer({"type": "lamb", "params": {"lr": 2e-3, "betas": [0.8, 0.99], "eps": 1e-6,
                                                  "weight_decay": 0.01, "max_coeff": 5.0, "min_coeff": 0.1,
                                                  "bias_correction": False, "eps_inside_sqrt": True}})
    assert (lamb.type, lamb.torch_class_name, lamb.fused_kernel) == ("Lamb", "Lamb", False)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(3))], lamb.torch_class_name, lamb.torch_kwargs())
    assert type(opt) is Lamb and opt.defaults == {"lr": 2e-3, "bias_correction": False, "betas": (0.8, 0.99),
                                                  "eps": 1e-6, "eps_inside_sqrt": True, "weight_decay": 0.01,
                                                  "max_coeff": 5.0, "min_coeff": 0.1}
    lion = _optimizer({"type": "LION", "params": {"lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.1,
                                                  "set_grad_none": True}})
    assert (lion.type, lion.torch_class_name) == ("Lion", "Lion")
    assert lion.torch_kwargs() == {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.1}  # set_grad_none dropped
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(3))], "Lion", lion.torch_kwargs())
    assert type(opt) is Lion and opt.defaults["betas"] == (0.9, 0.99)
    empty = build_optimizer([torch.nn.Parameter(torch.zeros(3))], "Lion", _optimizer({"type": "Lion"}).torch_kwargs())
    assert empty.defaults == {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}


def test_auto_params_come_from_the_client_optimizer():
    client = Lion([torch.nn.Parameter(torch.zeros(1))], lr=3e-4, betas=(0.95, 0.98))
    lion = _optimizer({"type": "Lion", "params": {"lr": "auto", "betas": "auto"}}, client_optimizer=client)
    assert lion.params == {"lr": 3e-4, "betas": [0.95, 0.98]}


@pytest.mark.parametrize("section,fragment", [
    ({"type": "Lion", "params": {"eps": 1e-8}},
     "optimizer.params.eps: unknown parameter for zerospeed.optim.Lion"),
    ({"type": "Lion", "params": {"adam_w_mode": True}}, "valid: lr, betas, weight_decay, set_grad_none"),
    ({"type": "Lion", "params": {"betas": [0.9, 1.5]}}, "optimizer.params.betas: must be a list of two numbers"),
    ({"type": "Lamb", "params": {"amsgrad": True}}, "Lamb has no AMSGrad variant"),
    ({"type": "Lamb", "params": {"min_coeff": 2.0, "max_coeff": 1.0}}, "min_coeff: = 2.0 is above max_coeff = 1.0"),
    ({"type": "Lamb", "params": {"max_coeff": -1}}, "optimizer.params.max_coeff: must be a number >= 0"),
    ({"type": "Lamb", "params": {"bias_correction": "yes"}}, "bias_correction: must be true or false"),
    ({"type": "Lamb", "params": {"max_grad_norm": 1.0}}, "use the top-level 'gradient_clipping'"),
    ({"type": "Lamb", "params": {"max_coef": 1.0}}, "did you mean 'max_coeff'?"),
    ({"type": "Lamm"}, "did you mean 'Lamb'?"),
])
def test_config_errors_name_the_key_and_the_fix(section, fragment):
    assert fragment in _error(section)


def test_lamb_is_refused_at_zero_stages_1_to_3_and_lion_runs_everywhere():
    lamb, lion = _optimizer({"type": "Lamb"}), _optimizer({"type": "Lion"})
    check_optimizer_for_stage(lamb, 0)
    for stage in (1, 2, 3):
        with pytest.raises(NotImplementedError, match=f"stage={stage}.*flat partition slices.*\"stage\": 0"):
            check_optimizer_for_stage(lamb, stage)
        check_optimizer_for_stage(lion, stage)
    check_optimizer_for_stage(None, 3)


def test_initialize_refuses_lamb_at_stage_2_before_any_process_group():
    import zerospeed

    model = torch.nn.Linear(2, 2)
    cfg = {**BASE, "optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 2}}
    with pytest.raises(NotImplementedError, match="Lamb' cannot run at zero_optimization.stage=2"):
        zerospeed.initialize(model=model, config=cfg)
    assert not torch.distributed.is_initialized()


def test_own_optimizer_params_match_the_class_signatures():
    for name, cls in (("Lamb", Lamb), ("Lion", Lion)):
        sig = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]
        assert tuple(sig) == OWN_OPTIMIZER_PARAMS[name]


def test_factory_names_its_own_optimizers_in_errors():
    with pytest.raises(ValueError, match=r"unknown optimizer 'lion'.*Did you mean 'Lion'"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], "lion", {})
    with pytest.raises(ValueError, match=r"unknown parameter 'eps' for zerospeed.optim.Lion"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], "Lion", {"eps": 1e-8})


# ---- zerospeed.ops: DeepSpeed's class names --------------------------------------------------------
def test_ops_names_have_deepspeeds_signatures_and_updates():
    from zerospeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from zerospeed.ops.lamb import FusedLamb
    from zerospeed.ops.lion import DeepSpeedCPULion, FusedLion

    sig = list(inspect.signature(FusedAdam.__init__).parameters)[1:-1]
    assert sig == ["params", "lr", "bias_correction", "betas", "eps", "adam_w_mode", "weight_decay", "amsgrad",
                   "set_grad_none"]
    x0 = _tensors(torch.float32)
    for cls, kw, ref_cls, ref_kw in (
            (FusedAdam, {"lr": 0.01, "weight_decay": 0.1}, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
            (FusedAdam, {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}, torch.optim.Adam,
             {"lr": 0.01, "weight_decay": 0.1}),
            (DeepSpeedCPUAdam, {"lr": 0.01}, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.0}),
            (FusedLamb, {"lr": 0.01}, Lamb, {"lr": 0.01}),
            (FusedLion, {"lr": 0.01}, Lion, {"lr": 0.01}),
            (DeepSpeedCPULion, {"lr": 0.01}, Lion, {"lr": 0.01})):
        got, opt = _run(cls, x0, 3, **kw)
        ref, _ = _run(ref_cls, x0, 3, **ref_kw)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fused kernel: about 1 ulp per step
        opt.zero_grad()
        assert all(p.grad is None for p in opt.param_groups[0]["params"])
    adam = FusedAdam([torch.nn.Parameter(torch.zeros(2))])
    assert adam.defaults["fused"] and adam.defaults["decoupled_weight_decay"]
    rebuilt = FusedAdam([torch.nn.Parameter(torch.zeros(2))], **adam.defaults)  # as a ZeRO stage rebuilds it
    assert rebuilt.defaults == adam.defaults
    with pytest.raises(NotImplementedError, match="bias_correction"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], bias_correction=False)
    lion = FusedLion([torch.nn.Parameter(torch.zeros(2))], set_grad_none=False)
    lion.param_groups[0]["params"][0].grad = torch.ones(2)
    lion.zero_grad()
    assert torch.equal(lion.param_groups[0]["params"][0].grad, torch.zeros(2))
