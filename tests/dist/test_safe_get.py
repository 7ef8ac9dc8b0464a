"""DeepSpeed's `deepspeed.utils` accessors (`safe_get_full_*`, `safe_set_full_*`) and `zero_to_fp32`
on real gloo ranks, stages 0-3, against single-process plain PyTorch on the same global batch.

fp32: gradients (after backward, before step) to 1e-6 relative, AdamW's exp_avg / exp_avg_sq after
the step to 1e-5 (only the summation order of the two-rank average differs); masters after the step
equal the parameters the forward uses exactly and PyTorch's to 2 lr (Adam's first step is about
lr * sign(g), so rounding-level gradients may move either way).
bf16 (stage 3): the fp32 masters' gradients, rounded compute, so a loose 2e-2 against fp32 PyTorch;
the masters rounded to bf16 are exactly the parameters the forward uses.
"""
from pathlib import Path

import pytest
import torch

import zerospeed
from zerospeed.testing.models import random_tokens, tiny_gpt
from zerospeed.testing.parity import global_batches, micro_batches
from zerospeed.testing.spawn import run_distributed
from zerospeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                             safe_get_local_fp32_param, safe_set_full_fp32_param, safe_set_full_optimizer_state)
from zerospeed.utils.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint,
                                          load_state_dict_from_zero_checkpoint)

LR, WD, MICRO = 1e-3, 0.01, 2
MODEL = dict(seed=0, bias=False)
CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")]
GRAD_TOL = {"fp32": 1e-6, "bf16": 5e-2}  # bf16: the forward and backward run in bf16
STATE_TOL = {"fp32": 1e-5, "bf16": 5e-2}  # bf16: exp_avg_sq ~ g^2 doubles the gradient error
SET_NAME = "blocks.0.attn.qkv.weight"  # the parameter overwritten with safe_set_full_fp32_param


def ds_config(stage, precision):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000}}
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _batch(world):
    return global_batches(random_tokens(MICRO * world, 32, seed=1), MICRO * world, 1)[0]


def _probe():
    """A fixed input every rank evaluates after safe_set_full_fp32_param."""
    t = random_tokens(2, 32, seed=7)
    return t[:, :-1], t[:, 1:]


def _bump(value):
    return value * 0.5 + 0.25


def _nonzero(t):
    """None or zeros before the first step (DeepSpeed too creates zero states at initialization)."""
    return t is not None and bool(t.ne(0).any())


def _cpu(d):
    return {k: None if v is None else v.detach().clone().cpu() for k, v in d.items()}


def rank_body(rank, world, root):
    out = {}
    x, y = micro_batches(_batch(world), rank, world, 1)[0]
    px, py = _probe()
    for stage, precision in CASES:
        model = tiny_gpt(**MODEL)
        engine, _, _, _ = zerospeed.initialize(model=model, config=ds_config(stage, precision))
        named = list(model.named_parameters())
        res = {"grad_before": [n for n, p in named if safe_get_full_grad(p) is not None],
               "state_before": [n for n, p in named if _nonzero(safe_get_full_optimizer_state(p, "exp_avg"))]}
        loss = engine(x, y)
        engine.backward(loss)
        res["grads"] = _cpu({n: safe_get_full_grad(p) for n, p in named})
        engine.step()
        res["params"] = _cpu({n: safe_get_full_fp32_param(p) for n, p in named})
        res["exp_avg"] = _cpu({n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in named})
        res["exp_avg_sq"] = _cpu({n: safe_get_full_optimizer_state(p, "exp_avg_sq") for n, p in named})
        res["missing_state"] = safe_get_full_optimizer_state(named[0][1], "no_such_state")
        res["local_numel"] = sum(safe_get_local_fp32_param(p).numel() for _, p in named)
        res["shapes"] = {n: tuple(p.shape) for n, p in named}
        with zerospeed.zero.GatheredParameters([p for _, p in named]):  # (stages 0-2: pass-through)
            res["compute"] = _cpu({n: p for n, p in named})
        if stage == 2 and precision == "fp32":  # checkpoint, read back without processes
            engine.save_checkpoint(Path(root) / "ckpt")
        # set a master and an optimizer state, then every rank's forward uses the new value
        target = dict(named)[SET_NAME]
        new = _bump(res["params"][SET_NAME])
        safe_set_full_fp32_param(target, new)
        safe_set_full_optimizer_state(target, torch.full_like(new, 0.125), "exp_avg")
        res["after_set"] = safe_get_full_fp32_param(target).clone()
        res["exp_avg_after_set"] = safe_get_full_optimizer_state(target, "exp_avg").clone()
        with torch.no_grad():
            res["probe_loss"] = float(engine(px, py))
        engine.destroy()
        out[(stage, precision)] = res
    if rank == 0:
        out["ckpt_sd"] = get_fp32_state_dict_from_zero_checkpoint(Path(root) / "ckpt")
        from zerospeed.runtime.consolidate import convert_to_fp32
        from safetensors.torch import load_file

        convert_to_fp32(Path(root) / "ckpt", Path(root) / "fp32")
        out["consolidated"] = load_file(str(Path(root) / "fp32" / "model.safetensors"))
        fresh = load_state_dict_from_zero_checkpoint(tiny_gpt(seed=5, bias=False), Path(root) / "ckpt")
        out["loaded"] = _cpu(fresh.state_dict())
    return out


def reference(world):
    """Plain PyTorch, one process: gradients, then one AdamW step."""
    model = tiny_gpt(**MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    gx, gy = _batch(world)
    model(gx, gy).backward()
    named = list(model.named_parameters())
    grads = {n: p.grad.detach().clone() for n, p in named}
    opt.step()
    params = {n: p.detach().clone() for n, p in named}
    states = {k: {n: opt.state[p][k].clone() for n, p in named} for k in ("exp_avg", "exp_avg_sq")}
    return grads, params, states


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    world = 2
    root = tmp_path_factory.mktemp("safe_get")
    return run_distributed(rank_body, world, str(root), timeout=180), reference(world)


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
def test_full_values_match_plain_pytorch(runs, case):
    outs, (grads, params, states) = runs
    precision = case[1]
    for r, out in enumerate(outs):
        res = out[case]
        assert res["grad_before"] == [] and res["state_before"] == [], (r, res["grad_before"], res["state_before"])
        assert res["missing_state"] is None
        assert set(res["grads"]) == set(grads)
        for n in grads:
            assert res["grads"][n].shape == grads[n].shape and res["grads"][n].dtype == torch.float32, n
            assert _rel(res["grads"][n], grads[n]) < GRAD_TOL[precision], (r, n, _rel(res["grads"][n], grads[n]))
            # Adam's first step moves each element by about lr * sign(g): elements whose gradient is at
            # rounding level (summation order) may move differently, by at most 2 lr
            assert float((res["params"][n] - params[n]).abs().max()) <= 2.01 * LR, (r, n)
            for k in ("exp_avg", "exp_avg_sq"):
                assert _rel(res[k][n], states[k][n]) < STATE_TOL[precision], (r, n, k, _rel(res[k][n], states[k][n]))
            # and they are AdamW's first-step states of the very gradient safe_get_full_grad returned
            g = res["grads"][n]
            assert _rel(res["exp_avg"][n], 0.1 * g) < 1e-6 and _rel(res["exp_avg_sq"][n], 0.001 * g * g) < 1e-5, (r, n)
        if precision == "fp32":
            assert all(torch.equal(outs[0][case][f][n], res[f][n]) for f in ("grads", "params") for n in grads)
        for n, v in res["compute"].items():  # the parameters the forward uses: the masters (bf16: rounded)
            assert torch.equal(v, res["params"][n].to(v.dtype)), n
    # every element is owned by exactly one rank
    assert sum(out[case]["local_numel"] for out in outs) == sum(v.numel() for v in grads.values())


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
def test_safe_set_reaches_every_rank_forward(runs, case):
    outs, _ = runs
    tol = 1e-6 if case[1] == "fp32" else 2e-2
    for out in outs:
        res = out[case]
        # plain PyTorch with the values safe_get returned and the one safe_set wrote
        model = tiny_gpt(**MODEL)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(res["after_set"] if n == SET_NAME else res["params"][n])
            probe = float(model(*_probe()))
        assert torch.equal(res["after_set"], _bump(res["params"][SET_NAME]))
        assert torch.equal(res["exp_avg_after_set"], torch.full_like(res["after_set"], 0.125))
        assert abs(res["probe_loss"] - probe) / abs(probe) < tol, (case, res["probe_loss"], probe)
    assert outs[0][case]["probe_loss"] == outs[1][case]["probe_loss"]


def test_zero_to_fp32_state_dict_equals_consolidated(runs):
    outs, _ = runs
    sd, consolidated, loaded = outs[0]["ckpt_sd"], outs[0]["consolidated"], outs[0]["loaded"]
    assert set(sd) == set(consolidated)
    for k in sd:
        assert torch.equal(sd[k], consolidated[k]), k
    params = outs[0][(2, "fp32")]["params"]
    for n, v in params.items():
        assert sd[n].dtype == torch.float32 and torch.equal(sd[n], v), n
    assert set(loaded) <= set(sd)
    for k, v in loaded.items():
        assert torch.equal(v, sd[k].to(v.dtype)), k


def test_unmanaged_parameter_gives_none():
    p = torch.nn.Parameter(torch.ones(3))
    assert safe_get_full_fp32_param(p) is None and safe_get_full_grad(p) is None
    assert safe_get_full_optimizer_state(p, "exp_avg") is None
