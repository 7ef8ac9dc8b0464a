"""build_optimizer: class, implementation choice (foreach / fused), kwargs, param groups, errors."""
from __future__ import annotations

import pytest
import torch

from zerospeed.optim import TORCH_OPTIMIZERS, build_optimizer
from zerospeed.optim import factory


def _params(n=3, device="cpu"):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, device=device)) for _ in range(n)]


def _step_both(ours, ours_p, ref, ref_p, *, steps):
    """Give both optimizers the same random gradients (seed 1) and step them `steps` times."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for a, b in zip(ours_p, ref_p):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_class_chosen_and_torch_default_on_cpu(name):
    opt = build_optimizer(_params(), name, {"lr": 0.01})
    assert type(opt) is getattr(torch.optim, name)
    assert opt.defaults["lr"] == 0.01
    assert not opt.defaults.get("foreach") and not opt.defaults.get("fused")  # torch's per-tensor loop


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_fused_cpu_picks_the_fused_kernel_where_torch_has_one(name):
    opt = build_optimizer(_params(), name, {"lr": 0.01}, fused_cpu=True)
    has_fused = name != "RMSprop"
    assert bool(opt.defaults.get("fused")) is has_fused and not opt.defaults.get("foreach")
    strided = torch.nn.Parameter(torch.zeros(4, 6)[:, :3])  # a strided view: torch's loop, not fused
    assert not build_optimizer([strided], name, {"lr": 0.01}, fused_cpu=True).defaults.get("fused")


def test_kwargs_passed_and_json_betas_become_a_tuple():
    opt = build_optimizer(
        _params(), "AdamW", {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    )
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.1)
    sgd = build_optimizer(_params(), "SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True})
    assert sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"] is True


def test_param_groups_and_generators():
    ps = _params(4)
    opt = build_optimizer(
        ({"params": ps[:2], "weight_decay": 0.0}, {"params": iter(ps[2:]), "lr": 0.5, "betas": [0.5, 0.6]}),
        "Adam",
        {"lr": 0.01, "weight_decay": 0.1},
    )
    g0, g1 = opt.param_groups
    assert g0["params"] == ps[:2] and g0["weight_decay"] == 0.0 and g0["lr"] == 0.01
    assert g1["params"] == ps[2:] and g1["lr"] == 0.5 and g1["betas"] == (0.5, 0.6)
    assert not g0["foreach"] and not g1["foreach"]
    gen = build_optimizer((p for p in ps), "SGD", {"lr": 0.1})
    assert gen.param_groups[0]["params"] == ps
    single = build_optimizer(ps[0], "SGD", {"lr": 0.1})
    assert single.param_groups[0]["params"] == [ps[0]]


def test_user_choice_of_implementation_is_kept():
    opt = build_optimizer(_params(), "Adam", {"lr": 0.01, "foreach": False})
    assert opt.defaults["foreach"] is False and not opt.defaults["fused"]
    opt = build_optimizer(_params(), "Adam", {"lr": 0.01, "fused": True})
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    opt = build_optimizer([{"params": _params(), "foreach": False}], "AdamW", {"lr": 0.01})
    assert opt.param_groups[0]["foreach"] is False and not opt.defaults["foreach"]
    opt = build_optimizer(_params(), "SGD", {"lr": 0.01, "differentiable": True})
    assert not opt.defaults["foreach"] and not opt.defaults["fused"]


def test_fused_chosen_on_a_fused_capable_accelerator(monkeypatch):
    # No accelerator here: pretend the "meta" device type has fused kernels.
    monkeypatch.setattr(factory, "_fused_devices", lambda: {"meta", "cpu"})
    meta = [torch.nn.Parameter(torch.empty(4, device="meta"))]
    for name in ("Adam", "AdamW", "SGD", "Adagrad"):
        opt = build_optimizer(meta, name, {"lr": 0.01})
        assert opt.defaults["fused"] is True and not opt.defaults["foreach"], name
    rms = build_optimizer(meta, "RMSprop", {"lr": 0.01})  # no fused kernel: torch's default
    assert rms.defaults["foreach"] is None and not rms.defaults.get("fused")
    mixed = build_optimizer(meta + _params(1), "Adam", {"lr": 0.01})  # one CPU param: torch's default
    assert mixed.defaults["foreach"] is None and not mixed.defaults["fused"]


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad", "RMSprop"])
def test_cpu_steps_are_bitwise_equal_to_default_torch(name):
    kwargs = {"lr": 0.01, "weight_decay": 0.01}
    if name in ("SGD", "RMSprop"):
        kwargs["momentum"] = 0.9
    ours_p, ref_p = _params(), _params()
    ours = build_optimizer(ours_p, name, kwargs)
    ref = getattr(torch.optim, name)(ref_p, **kwargs)
    _step_both(ours, ours_p, ref, ref_p, steps=3)
    for a, b in zip(ours_p, ref_p):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_fused_cpu_steps_match_default_torch_to_1e6(name):
    # 20 steps; the fused kernel rounds differently from torch's loop (about 1 ulp per step).
    kwargs = {"lr": 0.01, "weight_decay": 0.01}
    ours_p, ref_p = _params(), _params()
    ours = build_optimizer(ours_p, name, kwargs, fused_cpu=True)
    ref = getattr(torch.optim, name)(ref_p, **kwargs)
    assert ours.defaults["fused"] is True
    _step_both(ours, ours_p, ref, ref_p, steps=20)
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_fused_cpu_strided_gradient_is_copied_and_strided_state_refused():
    """torch's CPU fused Adam reads a strided gradient as contiguous memory (wrong numbers); the
    step pre-hook build_optimizer adds makes the gradient contiguous first."""
    torch.manual_seed(0)
    grad_src = torch.randn(4, 6)
    results = []
    for fused_cpu in (False, True):
        p = torch.nn.Parameter(torch.ones(4, 3))
        opt = build_optimizer([p], "AdamW", {"lr": 0.1}, fused_cpu=fused_cpu)
        for _ in range(2):
            p.grad = grad_src[:, 3:]  # column block: strides (6, 1)
            opt.step()
        results.append(p.detach().clone())
        assert bool(opt.defaults.get("fused")) is fused_cpu
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=0)
    opt.state[p]["exp_avg"] = torch.zeros(4, 6)[:, :3]
    p.grad = grad_src[:, :3].contiguous()
    with pytest.raises(RuntimeError, match=r"state 'exp_avg'.*strided view.*torch_adam"):
        opt.step()


def test_unknown_optimizer_names_closest():
    with pytest.raises(ValueError, match=r"unknown optimizer 'adamw'.*Did you mean 'AdamW'.*Valid names:.*SGD"):
        build_optimizer(_params(), "adamw", {})
    with pytest.raises(ValueError, match=r"'Adamm'.*Did you mean 'Adam"):
        build_optimizer(_params(), "Adamm", {})
    with pytest.raises(ValueError, match="unknown optimizer 'Optimizer'"):
        build_optimizer(_params(), "Optimizer", {})


def test_unknown_kwarg_names_closest_and_max_grad_norm_rejected():
    with pytest.raises(ValueError, match=r"'weight_decy'.*torch.optim.AdamW.*Did you mean 'weight_decay'"):
        build_optimizer(_params(), "AdamW", {"weight_decy": 0.1})
    with pytest.raises(ValueError, match="gradient_clipping"):
        build_optimizer(_params(), "Adam", {"lr": 0.1, "max_grad_norm": 1.0})


def test_mixed_tensors_and_groups_rejected():
    ps = _params(2)
    with pytest.raises(TypeError, match="mix"):
        build_optimizer([ps[0], {"params": [ps[1]]}], "SGD", {"lr": 0.1})
