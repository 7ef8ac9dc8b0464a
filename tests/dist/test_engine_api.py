"""DeepSpeed's engine contract, on 2 real gloo ranks: return values, boundaries, LR, no_sync, data."""
import pytest
import torch
import torch.distributed as dist

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.optim import WarmupDecayLR
from zerospeed.testing.models import random_tokens, tiny_gpt
from zerospeed.testing.spawn import run_distributed

SCHED = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
                                              "total_num_steps": 10, "warmup_type": "linear"}}


def base_config(**extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    cfg.update(extra)
    return cfg


def contract(rank, world):
    out = {}
    x, y = random_tokens(2, 64, seed=rank)[:, :-1], random_tokens(2, 64, seed=rank)[:, 1:]
    # config optimizer + scheduler; LR moves only at accumulation boundaries
    engine, opt, loader, sched = zerospeed.initialize(model=tiny_gpt(), config=base_config(scheduler=SCHED))
    out["types"] = (type(engine).__name__, type(opt).__name__, loader, type(sched).__name__)
    out["train_batch_size"] = engine.train_batch_size()
    lrs, boundaries = [], []
    for _ in range(12):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x, y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    out["lrs"], out["boundaries"], out["steps"] = lrs, boundaries, engine.global_steps
    engine.destroy()

    # client optimizer object is returned as-is; client scheduler callable receives it
    model = tiny_gpt()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}

    def make_sched(o):
        seen["opt"] = o
        return torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    engine, opt, _, sched = zerospeed.initialize(model=model, optimizer=client, lr_scheduler=make_sched,
                                                 config={"train_batch_size": 8})
    # only train_batch_size given: grad-accum 1, micro-batch = 8 / 2 ranks (DeepSpeed rule)
    out["client_same"] = (opt is client, seen["opt"] is client, engine.gradient_accumulation_steps(),
                          engine.train_micro_batch_size_per_gpu())
    engine.destroy()

    # no_sync: gradients stay local inside, are reduced by the first backward outside
    engine, _, _, _ = zerospeed.initialize(model=tiny_gpt(), config=base_config(gradient_accumulation_steps=1))
    p = next(engine.module.parameters())
    with engine.no_sync():
        engine.backward(engine(x, y))
        g_local = p.grad.clone()
        with pytest.raises(RuntimeError, match="re-entrant"):
            with engine.no_sync():
                pass
        with pytest.raises(RuntimeError, match="inside engine.no_sync"):
            engine.step()
    engine.backward(engine(x, y))
    g_reduced = p.grad.clone()
    both = [torch.zeros_like(g_local) for _ in range(world)]
    dist.all_gather(both, g_local)
    out["no_sync"] = (not torch.equal(both[0], both[1]),
                      torch.allclose(g_reduced, (both[0] + both[1]), rtol=1e-5, atol=1e-8))
    engine.step()
    engine.destroy()

    # training_data: a DataLoader over this rank's share, micro-batch sized
    data = torch.utils.data.TensorDataset(torch.arange(40).float())
    engine, _, loader, _ = zerospeed.initialize(model=tiny_gpt(), training_data=data, config=base_config())
    batches = [b[0] for b in loader]
    out["loader"] = (len(batches), batches[0].shape[0], sorted(torch.cat(batches).tolist()))
    engine.destroy()
    return out


def test_engine_contract():
    results = run_distributed(contract, 2)
    r = results[0]
    assert r["types"] == ("ZeroSpeedEngine", "AdamW", None, "WarmupDecayLR")  # "Adam" means AdamW
    assert r["train_batch_size"] == 8 and r["steps"] == 6
    assert r["boundaries"] == [False, True] * 6
    # expected: the scheduler's own sequence, stepped once per boundary
    ref_opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    ref = WarmupDecayLR(ref_opt, **SCHED["params"])
    expected = []
    for i in range(12):
        if i % 2 == 1:
            ref.step()
        expected.append(ref_opt.param_groups[0]["lr"])
    assert r["lrs"] == pytest.approx(expected, rel=1e-12)
    assert r["client_same"] == (True, True, 1, 4)
    assert r["no_sync"] == (True, True)
    # 40 samples, 2 ranks, micro-batch 2: 10 batches each, disjoint halves that cover the data
    n0, b0, s0 = results[0]["loader"]
    n1, b1, s1 = results[1]["loader"]
    assert (n0, b0, n1, b1) == (10, 2, 10, 2) and sorted(s0 + s1) == list(range(40))


def test_config_errors_come_before_any_process_group():
    with pytest.raises(ConfigError, match="train_batch_size=34"):  # 17 x 2 x dp 1: shows the numbers
        zerospeed.initialize(model=tiny_gpt(), config={"train_batch_size": 33, "train_micro_batch_size_per_gpu": 17,
                                                       "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError, match="gradient_clipping"):
        zerospeed.initialize(model=tiny_gpt(), config={"train_batch_size": 8, "gradient_clippin": 1.0})
    assert not dist.is_initialized()


def test_unimplemented_features_say_so(monkeypatch):
    with monkeypatch.context() as m:  # partial offload is an error where an accelerator would hold the rest
        m.setattr(torch.accelerator, "is_available", lambda: True)
        with pytest.raises(NotImplementedError, match="offload_optimizer.ratio=0.5"):
            zerospeed.initialize(model=tiny_gpt(), config={"train_batch_size": 8, "zero_optimization": {
                "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    with pytest.raises(NotImplementedError, match="bf16_master_weights_and_grads"):
        zerospeed.initialize(model=tiny_gpt(), config={"train_batch_size": 8, "zero_optimization": {"stage": 1},
                                                       "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    with pytest.raises(RuntimeError, match=r"mpu=\.\.\.\) needs torch.distributed initialised first"):
        zerospeed.initialize(model=tiny_gpt(), mpu=object(), config={"train_batch_size": 8})
    assert not dist.is_initialized()
