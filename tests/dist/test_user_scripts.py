"""What DeepSpeed users' scripts do, run unchanged on zerospeed (issue 17), world size 2.

1. HF `model.gradient_checkpointing_enable()` (reentrant and not) on a tiny GPT-2 at ZeRO stages 0-3.
2. Knowledge distillation: a stage-3 teacher engine without an optimizer (inference under no_grad) and
   a student engine (stage 2, stage 3) in the same process, student trained on KL(teacher || student).
3. Evaluation under `engine.eval()` + `torch.no_grad()` at stage 3: no gathered parameter is left
   behind, the eval loss is plain PyTorch's, and training continues correctly after `engine.train()`
   (also after the same evaluation without no_grad).
Each compares per-step losses with plain single-process PyTorch on the same global batch (fp32).
"""
import pytest
import torch
import torch.nn.functional as F

from zerospeed.testing.models import tiny_hf_gpt2
from zerospeed.testing.parity import global_batches, max_rel_diff
from zerospeed.testing.spawn import run_distributed

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed "
                                   "(pip install -e '.[test]' installs it)")

STEPS, MICRO, WORLD, LR = 5, 2, 2, 3e-3
LOSS_TOL = 1e-6  # relative; only the gradient's summation order (two ranks vs one batch) differs
STAGES = (0, 1, 2, 3)
REENTRANT = (True, False)


def make_model(seed=0, n_layer=2):
    return tiny_hf_gpt2(seed, n_layer)


def tokens(steps=STEPS, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (MICRO * WORLD * steps, 33), generator=g)


def batches(steps=STEPS, seed=3):
    return [x for x, _ in global_batches(tokens(steps, seed), MICRO * WORLD, steps)]


def ds_config(stage, optimizer=True):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}
    return cfg


def global_mean(value):
    import torch.distributed as dist

    t = value.detach().double().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def mine(x, rank):
    return x[rank * MICRO:(rank + 1) * MICRO]


def reference_train(model, xs, opt=None, loss_fn=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    out = []
    for x in xs:
        loss = loss_fn(model, x) if loss_fn else model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


# -- 1. HF gradient checkpointing at stages 0-3 -------------------------------------------------------
def count_calls(module):
    """Count `module.forward` runs. transformers 5 checkpoints a block's `forward` (its hooks stay
    outside), so a submodule's forward runs twice per step when the block is recomputed in backward.
    (Patched on the instance: torch 2.13 runs no module hooks in a non-reentrant recompute.)"""
    calls, forward = [], module.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    module.forward = counted
    return calls


def grad_ckpt_runs(rank, world):
    import zerospeed

    out = {}
    for stage in STAGES:
        for reentrant in REENTRANT:
            model = make_model()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            model.train()
            calls = count_calls(model.transformer.h[0].mlp)
            engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config(stage))
            losses = []
            for x in batches():
                loss = engine(input_ids=mine(x, rank), labels=mine(x, rank)).loss
                engine.backward(loss)
                engine.step()
                losses.append(global_mean(loss))
            sharded = stage < 3 or all(u.status.value == "sharded" for u in engine.strategy.units)
            out[(stage, reentrant)] = (losses, len(calls), sharded)
            engine.destroy()
    return out


def test_hf_gradient_checkpointing_at_every_stage():
    results = run_distributed(grad_ckpt_runs, WORLD, timeout=300)[0]
    ref = reference_train(make_model(), batches())
    assert ref[-1] < ref[0]
    assert len(results) == len(STAGES) * len(REENTRANT)
    for key, (losses, calls, sharded) in results.items():
        assert calls == 2 * STEPS, (key, calls)  # checkpointing really ran (forward + recompute)
        assert sharded, key  # stage 3: nothing stays gathered after the step
        assert max_rel_diff(losses, ref) < LOSS_TOL, (key, losses, ref)


# -- 2. knowledge distillation: teacher engine (stage 3, no optimizer) + student engine ---------------
KD_STEPS, TEMP, ALPHA = 3, 2.0, 0.5
STUDENT_STAGES = (2, 3)


def kd_loss(out, teacher_logits):
    """Hinton et al.'s distillation loss: ALPHA * CE(labels) + (1 - ALPHA) * T^2 * KL(teacher || student).
    (With ALPHA = 0, two random-init models give KL gradients near 0 in many entries and Adam's first
    steps amplify their summation-order noise: plain PyTorch on two half-batches differs from one full
    batch by 1.5e-6 relative at step 3, measured, against 1.6e-7 with the CE term.)"""
    s = F.log_softmax(out.logits / TEMP, dim=-1)
    t = F.log_softmax(teacher_logits / TEMP, dim=-1)
    return ALPHA * out.loss + (1 - ALPHA) * F.kl_div(s, t, log_target=True, reduction="batchmean") * TEMP ** 2


def kd_runs(rank, world):
    import zerospeed

    teacher_model = make_model(seed=1, n_layer=3)
    teacher, t_opt, _, _ = zerospeed.initialize(model=teacher_model, config=ds_config(3, optimizer=False))
    teacher.eval()
    out = {"teacher_opt_none": t_opt is None}
    for stage in STUDENT_STAGES:
        model = make_model()
        student, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=ds_config(stage))
        losses = []
        for x in batches(KD_STEPS, seed=5):
            xm = mine(x, rank)
            with torch.no_grad():
                t_logits = teacher(input_ids=xm).logits
            loss = kd_loss(student(input_ids=xm, labels=xm), t_logits)
            student.backward(loss)
            student.step()
            losses.append(global_mean(loss))
        out[stage] = losses
        student.destroy()
    out["teacher_sharded"] = all(u.status.value == "sharded" for u in teacher.strategy.units)
    teacher.destroy()
    return out


def test_distillation_teacher_and_student_engines_in_one_process():
    r = run_distributed(kd_runs, WORLD, timeout=300)[0]
    assert r["teacher_opt_none"] and r["teacher_sharded"]
    teacher = make_model(seed=1, n_layer=3).eval()

    def loss_fn(model, x):
        with torch.no_grad():
            t = teacher(input_ids=x).logits
        return kd_loss(model(input_ids=x, labels=x), t)

    ref = reference_train(make_model(), batches(KD_STEPS, seed=5), loss_fn=loss_fn)
    assert ref[-1] < ref[0]
    for stage in STUDENT_STAGES:
        assert max_rel_diff(r[stage], ref) < LOSS_TOL, (stage, r[stage], ref)


# -- 3. evaluation at stage 3 between training steps --------------------------------------------------
EVAL_BATCHES = 3


def eval_runs(rank, world):
    import zerospeed
    from zerospeed.zero.stage3_params import ParamStatus

    model = make_model()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3))
    xs = batches()
    losses = []

    def train(part):
        for x in part:
            loss = engine(input_ids=mine(x, rank), labels=mine(x, rank)).loss
            engine.backward(loss)
            engine.step()
            losses.append(global_mean(loss))

    train(xs[:2])
    before = engine.strategy.memory_breakdown()["params"]
    engine.eval()
    evals = []
    with torch.no_grad():
        for x in batches(EVAL_BATCHES, seed=7):
            evals.append(global_mean(engine(input_ids=mine(x, rank), labels=mine(x, rank)).loss))
    after = engine.strategy.memory_breakdown()["params"]
    statuses = [u.status for u in engine.strategy.units]
    all_sharded = all(s is ParamStatus.SHARDED for s in statuses)
    module_training = engine.module.training
    # the same evaluation without no_grad (a script that forgot it): same losses; the units a backward
    # would reuse may stay gathered (bounded by stage3_max_live_parameters) until the next backward
    grad_evals = [global_mean(engine(input_ids=mine(x, rank), labels=mine(x, rank)).loss)
                  for x in batches(EVAL_BATCHES, seed=7)]
    engine.train()
    train(xs[2:])
    end = engine.strategy.memory_breakdown()["params"]
    end_sharded = all(u.status is ParamStatus.SHARDED for u in engine.strategy.units)
    engine.destroy()
    return {"losses": losses, "evals": evals, "before": before, "after": after, "all_sharded": all_sharded,
            "statuses": [s.value for s in statuses], "eval_mode": not module_training,
            "grad_evals": grad_evals, "end": end, "end_sharded": end_sharded}


def test_eval_under_no_grad_at_stage3_leaks_nothing():
    r = run_distributed(eval_runs, WORLD, timeout=300)[0]
    assert r["eval_mode"]
    assert r["all_sharded"], r["statuses"]
    assert r["after"] == r["before"], (r["before"], r["after"])
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    xs = batches()
    ref = reference_train(model, xs[:2], opt)
    model.eval()
    with torch.no_grad():
        ref_evals = [model(input_ids=x, labels=x).loss.item() for x in batches(EVAL_BATCHES, seed=7)]
    model.train()
    ref += reference_train(model, xs[2:], opt)
    assert max_rel_diff(r["evals"], ref_evals) < LOSS_TOL, (r["evals"], ref_evals)
    assert max_rel_diff(r["grad_evals"], ref_evals) < LOSS_TOL, (r["grad_evals"], ref_evals)
    assert r["end_sharded"] and r["end"] == r["before"], (r["before"], r["end"])
    assert max_rel_diff(r["losses"], ref) < LOSS_TOL, (r["losses"], ref)


# -- 4. DeepSpeed-Chat's ZeRO-3 helpers: parameters tested by their `ds_*` markers ------------------------
def _z3_params_to_fetch(param_list, ZeroParamStatus):
    """DeepSpeed-Chat's `dschat/utils/utils.py: _z3_params_to_fetch`, verbatim but for the enum passed in."""
    return [p for p in param_list if hasattr(p, 'ds_id') and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def dschat_runs(rank, world):
    import zerospeed as deepspeed
    from zerospeed.runtime.zero.partition_parameters import ZeroParamStatus

    model, ema = make_model(), make_model(seed=4)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3))
    ema_engine, _, _, _ = deepspeed.initialize(model=ema, config=ds_config(3, optimizer=False))
    x = batches(1)[0]
    loss = engine(input_ids=mine(x, rank), labels=mine(x, rank)).loss
    engine.backward(loss)
    engine.step()
    params = dict(engine.module.named_parameters())
    out = {"marked": all(hasattr(p, "ds_id") for p in params.values()),
           "ids_unique": len({p.ds_id for p in params.values()}) == len(params),
           "numel": {n: p.ds_numel for n, p in params.items()}, "shape": {n: tuple(p.ds_shape) for n, p in
                                                                          params.items()},
           "status_after_step": {p.ds_status for p in params.values()},
           # dschat's perf.py / SuperOffload's parameter count: p.ds_numel if hasattr(p, "ds_tensor") else p.numel()
           "count": sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in params.values()),
           "held": sum(p.ds_tensor.numel() for p in params.values()),
           "to_fetch": len(_z3_params_to_fetch(params.values(), ZeroParamStatus)) == len(params)}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        out["status_gathered"] = {p.ds_status for p in params.values()}
        out["to_fetch_gathered"] = len(_z3_params_to_fetch(params.values(), ZeroParamStatus))
    def save_zero_three_model(module):  # dschat's, as written there (the state dict kept, not torch.save'd)
        output_state_dict = {}
        for k, v in module.named_parameters():
            if hasattr(v, 'ds_id'):
                with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v], ZeroParamStatus), enabled=True):
                    v_p = v.data.cpu().clone()
            else:
                v_p = v.cpu()
            output_state_dict[k] = v_p
        return output_state_dict

    def moving_average(model, model_ema, beta, modifier_rank):  # dschat's, with or without modifier_rank
        with torch.no_grad():
            for param, param_ema in zip(model.parameters(), model_ema.parameters()):
                params_to_fetch = _z3_params_to_fetch([param, param_ema], ZeroParamStatus)
                with deepspeed.zero.GatheredParameters(params_to_fetch, modifier_rank=modifier_rank,
                                                       enabled=len(params_to_fetch) > 0):
                    param_ema.data.copy_(torch.lerp(param.data, param_ema.data, beta))

    # as DeepSpeed: without modifier_rank the edits made inside GatheredParameters are discarded on exit
    moving_average(engine.module, ema_engine.module, 0.5, None)
    out["unchanged"] = save_zero_three_model(ema_engine.module)
    moving_average(engine.module, ema_engine.module, 0.5, 0)
    saved = save_zero_three_model(ema_engine.module)
    trained = {}
    for k, v in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([v]):
            trained[k] = v.data.clone()
    engine.destroy()
    ema_engine.destroy()
    # with zero_optimization.enable_sanity_checks, an edit without modifier_rank is an error (DeepSpeed's)
    checked, _, _, _ = deepspeed.initialize(model=make_model(seed=4), config={
        **ds_config(3, optimizer=False), "zero_optimization": {"stage": 3, "enable_sanity_checks": True}})
    weight = checked.module.transformer.wte.weight
    with torch.no_grad():
        with deepspeed.zero.GatheredParameters([weight]):
            weight.data.add_(1.0)  # as DeepSpeed's check: `.data` has a version counter of its own, not seen
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):  # allowed
            weight.mul_(1.0)
        try:
            with deepspeed.zero.GatheredParameters([weight]):
                if rank == 1:  # one rank edits: every rank raises (the flag is all-reduced)
                    weight.add_(1.0)
            out["sanity"] = "no error"
        except RuntimeError as e:
            out["sanity"] = str(e)
    checked.destroy()
    out.update(saved=saved, trained=trained)
    return out


def test_deepspeed_chat_zero3_helpers_see_ds_markers_and_gather():
    """At ZeRO-3 every managed parameter carries DeepSpeed's `ds_id`, `ds_numel`, `ds_shape` (the full ones) and
    `ds_status` (NOT_AVAILABLE outside a forward, AVAILABLE inside `GatheredParameters`), so DeepSpeed-Chat's
    `_z3_params_to_fetch` finds them: `save_zero_three_model` then saves the full values, not the 0-element
    placeholders it silently saved before the markers existed, and the EMA update (`moving_average`) takes effect
    with `modifier_rank=0` and is discarded without it, as in DeepSpeed (dschat passes none: its ZeRO-3 EMA
    stays at its initial weights there too)."""
    ranks = run_distributed(dschat_runs, WORLD, timeout=300)
    r = ranks[0]
    full = dict(make_model().named_parameters())
    total = sum(p.numel() for p in full.values())
    assert all(x["count"] == total for x in ranks)  # the full count, not the 0-element placeholders'
    assert sum(x["held"] for x in ranks) == total and 0 < r["held"] < total  # ds_tensor: each rank's part
    assert r["marked"] and r["ids_unique"] and r["to_fetch"]
    assert r["numel"] == {n: p.numel() for n, p in full.items()}
    assert r["shape"] == {n: tuple(p.shape) for n, p in full.items()}
    assert {s.name for s in r["status_after_step"]} == {"NOT_AVAILABLE"}
    assert {s.name for s in r["status_gathered"]} == {"AVAILABLE"} and r["to_fetch_gathered"] == 0
    assert "in-place modification of ZeRO-3 parameters" in r["sanity"], r["sanity"]
    ema0 = dict(make_model(seed=4).named_parameters())
    assert r["saved"].keys() == r["unchanged"].keys() == ema0.keys()
    for k, v in r["saved"].items():
        assert torch.equal(r["unchanged"][k], ema0[k].detach()), k  # GatheredParameters without modifier_rank
        want = torch.lerp(r["trained"][k], ema0[k].detach(), 0.5)  # with modifier_rank=0
        assert v.shape == full[k].shape and torch.allclose(v, want, rtol=1e-6, atol=1e-7), k
