"""bf16 / fp16 mixed precision at ZeRO stages 0-3 on 2 real gloo ranks, one launch for everything.

Tolerances (measured here, then set ~10-20x above; all runs are deterministic, so they do not move):
- loss vs the fp32 run, max over the steps (20 "plain", 10 "clipped-accum-2"), relative: bf16
  measured <= 6.4e-5 -> 1e-3; fp16 <= 1.3e-5 -> 2e-4. Both stay below half an ulp of the format
  (bf16 2^-9 ~ 2e-3, fp16 2^-12 ~ 2.4e-4): the loss is a mean over 256 tokens per step computed in
  fp32, so per-element rounding largely averages out.
- gradient norm vs fp32 (proves unscaling before the norm and clipping: a missing unscale would be
  65536x off): bf16 measured <= 1.2e-3 -> 1e-2; fp16 <= 1.9e-4 -> 2e-3.
- stage N vs stage 0 in the same precision: "plain" (no clipping, no accumulation) measured exactly
  equal (same bf16/fp16 sums, same fp32 AdamW) -> 1e-6 on losses and final fp32 masters. With clipping
  and accumulation 2: the clip coefficient is computed in another order (1 fp32 ulp in the masters,
  which flips the bf16/fp16 rounding of a few parameters) and stages 2/3 reduce each micro-step in
  the low precision and add in fp32 while stages 0/1 add the two micro-step gradients first: losses
  measured <= 2.2e-5 (bf16), 3.7e-6 (fp16) over 10 steps -> 3e-4, 5e-5. (Final masters are not compared there:
  Adam turns those rounding-level gradient differences into lr-sized updates of elements whose
  gradient is ~0, as in test_stage0_parity.py; bf16/fp16 vs fp32 masters likewise differ by ~5%
  of max|w| for that reason, so they are compared through the loss.)
Memory (bf16, per rank, N = 2; stages 0-1 after the step, stages 2-3 after the last backward, as
they free gradients at the step): params 2Ψ (stage 3: 2Ψ/N), Adam 8Ψ/N, fp32 masters 4Ψ/N as in
the paper; gradients: stage 1 2Ψ (paper), stages 2 and 3 the 2-byte reduced partition 2Ψ/N (paper),
converted to fp32 at the step (with accumulation the second micro-step converts and adds in fp32).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerospeed
from zerospeed.comm.ops import start_all_gather
from zerospeed.precision import LossScaleAtMinimumError
from zerospeed.testing.models import Block, GPTConfig, random_tokens, tiny_gpt
from zerospeed.testing.parity import global_batches, max_rel_diff, state_max_rel_diff, train_engine
from zerospeed.testing.spawn import run_distributed
from zerospeed.zero.memory import estimate_model_states_memory

STEPS = 20
LR = 1e-3
MODEL = dict(seed=0, bias=False)  # see GPTConfig.bias
PRECISIONS, STAGES = ("bf16", "fp16"), (0, 1, 2, 3)
CASES = {"plain": (2, 1, 0.0, STEPS), "clipped-accum-2": (1, 2, 0.05, 10)}  # micro, gas, clip, steps
LOSS_TOL, NORM_TOL = {"bf16": 1e-3, "fp16": 2e-4}, {"bf16": 1e-2, "fp16": 2e-3}
STAGE0_TOL = {"plain": {"bf16": 1e-6, "fp16": 1e-6}, "clipped-accum-2": {"bf16": 3e-4, "fp16": 5e-5}}
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
INJECT = "blocks.0.fc.weight"
OVF_STEPS, OVF_AT = 8, (3, 5)
VARIANT_STEPS = 5
PSI = tiny_gpt(**MODEL).cfg.num_params()  # 119104 trainable elements (tied weight counted once)


def ds_config(stage, precision, micro=2, gas=1, clip=0.0, **sections):
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "gradient_clipping": clip,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    cfg.update(sections)
    return cfg


def full_masters(strategy) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master, gathered from all ranks' partitions (collective)."""
    world = dist.get_world_size()
    if strategy.stage == 0:
        return {n: m.detach().clone() for n, m in zip(strategy.names, strategy.master_params)}
    if strategy.stage in (1, 2):
        lay, master = strategy.layout, strategy.master.contiguous()
        parts = [torch.empty_like(master) for _ in range(world)]
        dist.all_gather(parts, master)
        flat = torch.stack(parts, 1).reshape(-1)  # [K, N, S]: chunk by chunk, rank by rank
        return {n: flat[slice(*lay.param_range(i))].view(p.shape).clone()
                for i, (n, p) in enumerate(zip(strategy.names, strategy.params))}
    out = {}
    for u in strategy.units:
        full = torch.empty(u.layout.padded_numel, dtype=u.shard.dtype)
        start_all_gather(full, u.shard.detach(), group=None).wait()
        out.update({sp.fqn: full[sp.offset:sp.offset + sp.numel].view(sp.shape).clone() for sp in u.params})
    return out


def _padding(strategy) -> int:
    if strategy.stage == 3:
        return sum(u.layout.padding for u in strategy.units)
    return strategy.layout.padding if strategy.stage else 0


def model_state(engine):
    s = engine.strategy
    if s.stage == 3:
        return s.consolidated_state_dict()
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def train_run(rank, world, stage, precision, case):
    micro, gas, clip, steps = CASES[case]
    model = tiny_gpt(**MODEL)
    engine, _, _, _ = zerospeed.initialize(model=model, config=ds_config(stage, precision, micro, gas, clip))
    batches = global_batches(random_tokens(micro * gas * world * steps, 64, seed=1), micro * gas * world, steps)
    norms, memory = [], []
    losses = train_engine(engine, batches, on_step=lambda e: norms.append(e.get_global_grad_norm()),
                          after_backward=lambda e: memory.append(e.memory_breakdown()))
    masters, state = full_masters(engine.strategy), model_state(engine)
    out = {"losses": losses, "norms": norms, "masters": masters,
           "master_dtypes": {m.dtype for m in engine.strategy.master_params},
           "param_dtypes": {p.dtype for p in model.parameters()},
           # the low-precision parameters are the masters rounded (and all-gathered) after the last step
           "params_are_rounded_masters": all(torch.equal(state[n], m.to(state[n].dtype)) for n, m in masters.items()),
           # stages 2-3 free their gradient partitions at the step: their model states are counted after
           # the last backward; stages 0-1 keep gradient buffers and create the fp32 partition inside the step
           "memory": memory[-1] if stage >= 2 else engine.memory_breakdown(), "padding": _padding(engine.strategy),
           "flags": (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.loss_scale, engine.skipped_steps)}
    engine.destroy()
    return out


def _inject_inf(model, rank, when):
    """On rank 1 only, put +inf into one element of INJECT's gradient while when() is true."""
    def hook(grad):
        if rank == 1 and when():
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad
    dict(model.named_parameters())[INJECT].register_hook(hook)


def overflow_run(rank, world, stage, precision, **sections):
    """OVF_STEPS steps with an inf gradient on rank 1 at steps OVF_AT; per step: scale, applied, lr,
    whether the masters and the model stayed exactly the same."""
    model = tiny_gpt(**MODEL)
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": LR / 10, "warmup_max_lr": LR, "warmup_num_steps": 100}}
    engine, opt, _, _ = zerospeed.initialize(model=model, config=ds_config(stage, precision, scheduler=sched,
                                                                            **sections))
    step = [0]
    _inject_inf(model, rank, lambda: step[0] in OVF_AT)
    trace = []
    for step[0], (x, y) in enumerate(global_batches(random_tokens(2 * world * OVF_STEPS, 64, seed=2), 2 * world,
                                                    OVF_STEPS)):
        before, state = full_masters(engine.strategy), model_state(engine)
        x, y = x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]
        engine.backward(engine(x, y))
        engine.step()
        after, state_after = full_masters(engine.strategy), model_state(engine)
        trace.append({"scale": engine.loss_scale, "applied": engine.was_step_applied(), "lr": engine.get_lr()[0],
                      "unchanged": all(torch.equal(before[k], after[k]) for k in before)
                      and all(torch.equal(state[k], state_after[k]) for k in state)})
    adam_steps = {int(opt.state[m]["step"]) for m in engine.strategy.master_params}
    out = {"trace": trace, "skipped": engine.skipped_steps, "global_steps": engine.global_steps,
           "adam_steps": adam_steps, "masters": full_masters(engine.strategy)}
    engine.destroy()
    return out


def collapse_run(rank, world, stage):
    """fp16 already at min_loss_scale: an inf gradient (rank 1) must raise on every rank, naming INJECT."""
    model = tiny_gpt(**MODEL)
    fp16 = {"enabled": True, "initial_scale_power": 0, "min_loss_scale": 1, "hysteresis": 1}
    engine, _, _, _ = zerospeed.initialize(model=model, config=ds_config(stage, "fp16", fp16=fp16))
    _inject_inf(model, rank, lambda: True)
    x, y = (t[rank * 2:(rank + 1) * 2] for t in global_batches(random_tokens(4, 64, seed=3), 4, 1)[0])
    engine.backward(engine(x, y))
    try:
        engine.step()
        message = "no error"
    except LossScaleAtMinimumError as exc:
        message = str(exc)
    engine.destroy()
    return message


def _short_run(engine, world, manual=False):
    """VARIANT_STEPS steps of the "plain" batches; manual: `engine.scale(loss).backward()` by hand."""
    losses = []
    for x, y in global_batches(random_tokens(2 * world * STEPS, 64, seed=1), 2 * world, STEPS)[:VARIANT_STEPS]:
        rank = dist.get_rank()
        loss = engine(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
        if manual:
            engine.scale(loss).backward()
        else:
            engine.backward(loss)
        engine.step()
        total = loss.detach().double()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    engine.destroy()
    return losses


def variants(rank, world):
    """engine.scale + a manual backward; fp32 gradient communication under bf16; bf16 from zero.Init."""
    out = {}
    engine, _, _, _ = zerospeed.initialize(model=tiny_gpt(**MODEL), config=ds_config(2, "fp16"))
    out["manual-scale"] = _short_run(engine, world, manual=True)
    for stage in (0, 1, 2, 3):
        cfg = ds_config(stage, "bf16", communication_data_type="fp32")
        out[("comm-fp32", stage)] = _short_run(zerospeed.initialize(model=tiny_gpt(**MODEL), config=cfg)[0], world)
    for name, init in (("init", True), ("no-init", False)):
        torch.manual_seed(0)
        with zerospeed.zero.Init(enabled=init):
            model = _Stack()
        out[("bf16-stage3", name)] = _short_run(zerospeed.initialize(model=model, config=ds_config(3, "bf16"))[0], world)
    return out


class _Stack(nn.Module):
    """Embedding, GPT blocks, a head: nothing re-initialised after the sub-modules exist (zero.Init)."""

    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(Block(GPTConfig(d_model=d, n_head=2, bias=False)) for _ in range(2))
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h).float().flatten(0, 1), y.reshape(-1))


def everything(rank, world):
    out = {("fp32", 0, case): train_run(rank, world, 0, "fp32", case) for case in CASES}
    out.update({(p, s, case): train_run(rank, world, s, p, case) for case in CASES for p in PRECISIONS for s in STAGES})
    out["overflow"] = {s: overflow_run(rank, world, s, "fp16") for s in STAGES}
    out["overflow-bf16"] = overflow_run(rank, world, 2, "bf16")
    out["collapse"] = {s: collapse_run(rank, world, s) for s in STAGES}
    out["variants"] = variants(rank, world)
    return out


@pytest.fixture(scope="module")
def world2():
    return run_distributed(everything, 2, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_norm_near_fp32_and_stages_equal_stage0(world2, case):
    for r in world2:
        ref = r[("fp32", 0, case)]
        for p in PRECISIONS:
            stage0 = r[(p, 0, case)]
            for s in STAGES:
                res = r[(p, s, case)]
                assert max_rel_diff(res["losses"], ref["losses"]) < LOSS_TOL[p], (p, s)
                assert max_rel_diff(res["norms"], ref["norms"]) < NORM_TOL[p], (p, s)
                assert max_rel_diff(res["losses"], stage0["losses"]) < STAGE0_TOL[case][p], (p, s)
                assert res["master_dtypes"] == {torch.float32} and res["param_dtypes"] == {LOW[p]}, (p, s)
                assert res["params_are_rounded_masters"], (p, s)
                fp16_on, bf16_on, scale, skipped = res["flags"]
                assert (fp16_on, bf16_on, skipped) == (p == "fp16", p == "bf16", 0)
                assert scale == (2.0**16 if p == "fp16" else 1.0)  # no overflow in these runs
                if case == "plain":
                    assert state_max_rel_diff(res["masters"], stage0["masters"]) < STAGE0_TOL[case][p], (p, s)
    for key in world2[0]:  # ranks agree exactly
        if isinstance(key, tuple):
            assert world2[0][key]["losses"] == world2[1][key]["losses"]
            assert state_max_rel_diff(world2[0][key]["masters"], world2[1][key]["masters"]) == 0.0


def test_memory_breakdown_bf16_matches_mixed_precision_formula(world2):
    for r in world2:
        for stage in STAGES:
            res = r[("bf16", stage, "plain")]
            mem = res["memory"]
            want = estimate_model_states_memory(PSI, stage, 2, "mixed")
            # every stage keeps the 2-byte reduced gradients until the step (the paper's 2Ψ, 2Ψ/N)
            for key in ("params", "grads", "optimizer_states", "master_weights"):
                assert abs(mem[key] - want[key]) <= 0.05 * want[key] + 16 * res["padding"], (stage, key, mem, want)


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(world2):
    s0 = 2.0**16
    # hysteresis 2 (default): the first overflow is absorbed, the second halves the scale
    want_scales = [s0] * 5 + [s0 / 2] * 3
    want_applied = [i not in OVF_AT for i in range(OVF_STEPS)]
    for stage in STAGES:
        r0, r1 = (r["overflow"][stage] for r in world2)
        for r in (r0, r1):
            trace = r["trace"]
            assert [t["scale"] for t in trace] == want_scales, stage
            assert [t["applied"] for t in trace] == want_applied, stage
            assert [t["unchanged"] for t in trace] == [not a for a in want_applied], stage  # only skips keep weights
            lrs = [t["lr"] for t in trace]  # a skipped step does not advance the LR schedule
            assert all((lrs[i] == lrs[i - 1]) == (i in OVF_AT) for i in range(1, OVF_STEPS)), (stage, lrs)
            assert r["skipped"] == len(OVF_AT) and r["global_steps"] == OVF_STEPS  # DeepSpeed counts both
            assert r["adam_steps"] == {OVF_STEPS - len(OVF_AT)}
        assert state_max_rel_diff(r0["masters"], r1["masters"]) == 0.0
        assert state_max_rel_diff(r0["masters"], world2[0]["overflow"][0]["masters"]) < 1e-6  # = stage 0
    for r in world2:  # bf16 with check_grad_overflow (default true): skipped too, no scale
        trace = r["overflow-bf16"]["trace"]
        assert [t["applied"] for t in trace] == want_applied and {t["scale"] for t in trace} == {1.0}


def test_fp16_overflow_at_the_minimum_scale_names_the_parameter(world2):
    for r in world2:
        for stage, message in r["collapse"].items():
            assert f"First parameters with non-finite (inf/nan) gradients: {INJECT}" in message, (stage, message)
            assert "min_loss_scale=1" in message and '"bf16": {"enabled": true}' in message


def test_manual_scale_fp32_communication_and_zero_init_in_bf16(world2):
    for r in world2:
        v = r["variants"]
        # engine.scale(loss).backward() + step() == engine.backward(loss) + step()
        assert v["manual-scale"] == r[("fp16", 2, "plain")]["losses"][:VARIANT_STEPS]
        for stage in STAGES:  # bf16 compute, fp32 gradient collectives: still near the fp32 run
            got, ref = v[("comm-fp32", stage)], r[("fp32", 0, "plain")]["losses"][:VARIANT_STEPS]
            assert max_rel_diff(got, ref) < LOSS_TOL["bf16"], stage
        # a model built partitioned under zero.Init trains exactly like the same model built whole
        assert v[("bf16-stage3", "init")] == v[("bf16-stage3", "no-init")]
