"""Config-built Lion and Lamb through `zerospeed.initialize` on 2 real gloo ranks equal plain PyTorch + the
same optimizer class in one process (same seed, same global batches; fp32).

Lion is elementwise, so it runs at every ZeRO stage on flat partition rows; Lamb needs whole parameters
and runs at stage 0 (stages 1-3 refuse it at config validation, before any tensor is created).
Tolerance: 1e-6 relative on every step's loss (only the gradient summation order differs). Both
resume from a checkpoint (saved at step 5, loaded into a differently initialised model) bit-exactly.
"""
import pytest
import torch

import zerospeed
from zerospeed.optim import Lamb, Lion
from zerospeed.testing.models import random_tokens, tiny_gpt
from zerospeed.testing.parity import global_batches, max_rel_diff, state_max_rel_diff, train_engine, train_reference
from zerospeed.testing.spawn import run_distributed

STEPS = 10
MICRO = 2
LOSS_TOL = 1e-6
MODEL = dict(seed=0, bias=False)
LION = {"lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.1}
LAMB = {"lr": 1e-3, "weight_decay": 0.01}
CASES = [("Lion", LION, 2), ("Lion", LION, 1), ("Lion", LION, 3), ("Lamb", LAMB, 0)]  # (type, params, stage)


def ds_config(name, params, stage):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": name, "params": params},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000}}


def _batches(world):
    return global_batches(random_tokens(MICRO * world * STEPS, 64, seed=1), MICRO * world, STEPS)


def resume_run(name, params, stage, world, ckpt_dir):
    """(losses of steps 5-9 trained on, losses of steps 5-9 after save at step 5 and load into a
    differently initialised model): the optimizer state survives a checkpoint."""
    batches = _batches(world)
    engine, _, _, _ = zerospeed.initialize(model=tiny_gpt(**MODEL), config=ds_config(name, params, stage))
    train_engine(engine, batches[:5])
    engine.save_checkpoint(f"{ckpt_dir}/{name}")
    straight = train_engine(engine, batches[5:])
    engine.destroy()
    engine, _, _, _ = zerospeed.initialize(model=tiny_gpt(seed=5, bias=False), config=ds_config(name, params, stage))
    engine.load_checkpoint(f"{ckpt_dir}/{name}")
    resumed = train_engine(engine, batches[5:])
    engine.destroy()
    return straight, resumed


def engine_runs(rank, world, ckpt_dir):
    out = {}
    for name, params, stage in CASES:  # one launch for the grid
        model = tiny_gpt(**MODEL)
        engine, _, _, _ = zerospeed.initialize(model=model, config=ds_config(name, params, stage))
        inner = getattr(engine.strategy, "optimizer", None)
        losses = train_engine(engine, _batches(world))
        if stage == 3:
            with zerospeed.zero.GatheredParameters(list(model.parameters())):
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out[(name, stage)] = {"losses": losses, "state": state, "class": type(inner).__name__}
        engine.destroy()
    out["resume"] = {name: resume_run(name, params, stage, world, ckpt_dir)
                     for name, params, stage in (("Lion", LION, 2), ("Lamb", LAMB, 0))}
    try:
        zerospeed.initialize(model=tiny_gpt(**MODEL), config=ds_config("Lamb", LAMB, 2))
        out["lamb_stage2"] = "no error"
    except NotImplementedError as exc:
        out["lamb_stage2"] = str(exc)
    return out


def reference_run(cls, params, world):
    model = tiny_gpt(**MODEL)
    kwargs = dict(params, betas=tuple(params["betas"])) if "betas" in params else dict(params)
    losses = train_reference(model, cls(model.parameters(), **kwargs), _batches(world))
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_distributed(engine_runs, 2, str(tmp_path_factory.mktemp("ckpt")))


def test_config_lion_at_zero_stage_2_trains_as_plain_pytorch_lion(world2):
    ref_losses, ref_state = reference_run(Lion, LION, 2)
    assert ref_losses[-1] < ref_losses[0]  # it trains
    for stage in (2, 1, 3):
        r0, r1 = world2[0][("Lion", stage)], world2[1][("Lion", stage)]
        for res in (r0, r1):
            assert res["class"] == "Lion"  # the strategy steps zerospeed's Lion over its partition
            assert max_rel_diff(res["losses"], ref_losses) < LOSS_TOL, stage
            assert state_max_rel_diff(res["state"], ref_state) < 1e-5, stage
        assert r0["losses"] == r1["losses"]


def test_config_lamb_at_stage_0_trains_as_plain_pytorch_lamb_and_is_refused_at_stage_2(world2):
    ref_losses, ref_state = reference_run(Lamb, LAMB, 2)
    assert ref_losses[-1] < ref_losses[0]
    for res in (world2[0][("Lamb", 0)], world2[1][("Lamb", 0)]):
        assert res["class"] == "Lamb"
        assert max_rel_diff(res["losses"], ref_losses) < LOSS_TOL
        assert state_max_rel_diff(res["state"], ref_state) < 1e-5
    msg = world2[0]["lamb_stage2"]
    assert "zero_optimization.stage=2" in msg and '"stage": 0' in msg


def test_lion_at_stage_2_and_lamb_at_stage_0_resume_from_a_checkpoint_exactly(world2):
    for name in ("Lion", "Lamb"):
        straight, resumed = world2[0]["resume"][name]
        assert resumed == straight, name
