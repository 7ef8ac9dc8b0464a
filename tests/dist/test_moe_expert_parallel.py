"""Expert parallelism (issue 25): `zerospeed.moe.layer.MoE(ep_size=2)` through `zerospeed.initialize` at ZeRO 0
on real gloo ranks, against one process that holds all experts and gates each rank's tokens separately (the
reference of the issue): per-step losses, l_aux and exp_counts equal, weights to 1e-5 relative after the
steps, for k = 1 and 2, at world 2 (ep 2) and 4 (ep 2 x dp 2), with SGD without clipping (a wrong gradient
scale shows: the expert gradients are summed over "expert_data" and averaged over "data") and AdamW with
clipping (the global norm counts each expert once and the dense parameters once)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zerospeed.testing.spawn import run_distributed

M, E, TOKENS, STEPS = 8, 4, 8, 3


class Net(nn.Module):
    def __init__(self, ep: int, k: int, drop_tokens: bool = True, capacity_factor: float = 1.0, moe_cls=None,
                 expert_rank: int | None = None):
        from zerospeed.moe.layer import MoE

        MoE = moe_cls or MoE  # noqa: N806 - DeepSpeed's class for the cross-check
        super().__init__()
        self.inp = nn.Linear(M, M)
        expert = nn.Sequential(nn.Linear(M, 2 * M), nn.ReLU(), nn.Linear(2 * M, M))
        self.moe = MoE(M, expert, num_experts=E, ep_size=ep, k=k, min_capacity=2, use_rts=False,
                       top2_2nd_expert_sampling=False, drop_tokens=drop_tokens, capacity_factor=capacity_factor)
        self.out = nn.Linear(M, M)
        # experts start different: global expert g shifted by 0.05 g (deep copies would start equal)
        local = E // ep
        rank = expert_rank if expert_rank is not None else dist.get_rank() % ep if ep > 1 else 0  # in its expert group
        with torch.no_grad():
            for i, ex in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                for p in ex.parameters():
                    p.add_(0.05 * (rank * local + i))

    def forward(self, x, y):
        out, l_aux, counts = self.moe(self.inp(x))
        return ((self.out(out) - y) ** 2).mean() + 0.1 * l_aux, l_aux, counts


def _data(world: int):
    g = torch.Generator().manual_seed(7)
    return [[(torch.randn(TOKENS, M, generator=g), torch.randn(TOKENS, M, generator=g)) for _ in range(world)]
            for _ in range(STEPS)]


def _config(optimizer: str, stage: int = 0) -> dict:
    opt = {"type": "SGD", "params": {"lr": 0.1}} if optimizer == "sgd" else \
        {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}
    return {"train_micro_batch_size_per_gpu": TOKENS, "gradient_accumulation_steps": 1, "optimizer": opt,
            "gradient_clipping": 0.0 if optimizer == "sgd" else 0.05, "zero_optimization": {"stage": stage},
            "comms_logger": {"enabled": True}}


def _reference(world: int, k: int, optimizer: str, unlimited: bool = False):
    """One process, every expert (ep 1): rank r's tokens gated alone, the loss the mean over ranks. unlimited:
    capacity k x S per expert (capacity_factor E, the padded layout), so no token is dropped."""
    torch.manual_seed(0)
    net = Net(1, k, capacity_factor=float(E) if unlimited else 1.0)
    if optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    steps = []
    for batch in _data(world):
        outs = [net(x, y) for x, y in batch]
        loss = sum(o[0] for o in outs) / world
        opt.zero_grad()
        loss.backward()
        if optimizer != "sgd":
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        steps.append([(float(o[0].detach()), float(o[1].detach()), o[2].tolist()) for o in outs])
    return steps, {n: p.detach().clone() for n, p in net.named_parameters()}


def _engine_run(rank: int, world: int, k: int, optimizer: str, dropless: bool = False, stage: int = 0,
                offload: dict | None = None):
    import zerospeed

    torch.manual_seed(0)
    net = Net(2, k, drop_tokens=not dropless)
    cfg, client = _config(optimizer.removesuffix("-groups"), stage), None
    if optimizer.endswith("-groups"):  # a client optimizer over DeepSpeed-MoE's groups: dense, then the experts
        from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer({"params": net.parameters(), "name": "dense"})
        client = torch.optim.AdamW(groups, **cfg.pop("optimizer")["params"])
    if offload:  # its "zero" entry: other zero_optimization keys
        cfg["zero_optimization"].update(offload.get("zero", {}))
        cfg["zero_optimization"]["offload_optimizer"] = {k: v for k, v in offload.items() if k != "zero"}
    engine, *_ = zerospeed.initialize(model=net, config=cfg, optimizer=client)
    assert engine.mesh.size("expert") == 2 and engine.mesh.size("expert_data") == world // 2
    swapped = getattr(engine.strategy, "swapped", None)
    if offload and offload["device"] == "nvme":  # one NVMe tier: the dense and the expert partition its masters
        assert swapped is not None and len(swapped.master_shapes) == 2
        assert swapped.num_groups == (2 if client is not None else 1)
        # the pre-flight's disk budget: master + 2 Adam states (its default) x this rank's shard, the experts'
        # over world / ep ranks (ep times the dense share per element)
        dense, experts = (sum(p.numel() for p in sub.params) for sub in engine.strategy.subs)
        assert engine.offload.budget.disk["optimizer"] == 3 * 4 * -(-(dense + 2 * experts) // world)
    steps = []
    for batch in _data(world):
        x, y = batch[rank]
        loss, l_aux, counts = engine(x, y)
        engine.backward(loss)
        engine.step()
        steps.append((float(loss), float(l_aux), counts.tolist()))
    a2a = engine.comms_logger.stats["all_to_all"]
    return steps, _global_params(engine, 2), (a2a.calls, a2a.elements), _partition_numels(engine)


def _partition_numels(engine) -> list:
    """Stages 1-2: (elements this rank's partition holds, its group's size) per parameter set (dense, experts)."""
    from zerospeed.zero.stage12_grouped import GroupedStage12Strategy

    if not isinstance(engine.strategy, GroupedStage12Strategy):
        return []
    def held(sub):  # NVMe: the master in the swap files, else the segments the optimizer steps
        if sub.swapped is not None:
            return sub.swapped.master_shapes[sub.swap_master].numel()
        return sum(t.numel() for t in sub.master_params)
    return [(held(sub), sub.world, sum(p.numel() for p in sub.params)) for sub in engine.strategy.subs]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_expert_parallel_matches_one_process(world, k, optimizer):
    results = run_distributed(_engine_run, world, k, optimizer)
    # 2 all-to-alls forward and 2 backward per step, each of the kept routes only (packed: no padding rows): over
    # the ranks, 4 x M x the routes kept, min(load, C) per expert
    capacity = max(2, -(-k * TOKENS // E))
    kept = sum(min(c, capacity) for r in results for _, _, counts in r[0] for c in counts)
    assert all(r[2][0] == 4 * STEPS for r in results)
    assert sum(r[2][1] for r in results) == 4 * M * kept < 4 * STEPS * world * E * capacity * M
    _compare(results, *_reference(world, k, optimizer))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("k", [1, 2])
def test_dropless_equals_unlimited_capacity(world, k):
    """drop_tokens=False runs the experts on exactly their tokens (variable all-to-all): the same training as
    one process with room for every token in the padded layout."""
    results = run_distributed(_engine_run, world, k, "adamw", True)
    # every route goes out and back, forward and backward: no padding rows
    assert all(r[2][0] == 4 * STEPS for r in results)
    assert sum(r[2][1] for r in results) == 4 * STEPS * world * k * TOKENS * M
    _compare(results, *_reference(world, k, "adamw", unlimited=True))


@pytest.mark.parametrize("stage,world,k,optimizer,offload", [(2, w, k, o, None) for w in (2, 4) for k in (1, 2)
                                                             for o in ("sgd", "adamw")]
                         + [(1, 4, 2, "sgd", None), (1, 4, 2, "adamw", None),  # stage 1: a full gradient
                            (2, 4, 2, "adamw", "cpu"),  # ZeRO-Offload: both partitions' masters on the host
                            # ZeRO-Infinity: in swap files (with a client optimizer's 2 groups: tiles cut at each)
                            (2, 4, 2, "adamw", "nvme"), (1, 2, 1, "sgd", "nvme"), (2, 4, 1, "adamw-groups", "nvme")])
def test_expert_parallel_zero12_matches_one_process(stage, world, k, optimizer, offload, tmp_path):
    """ZeRO 1-2: the dense parameters partitioned over the world, the experts over "expert_data" (world / 2
    ranks), one optimizer; the same training as the one-process reference (SGD: a wrong expert divisor shows;
    AdamW with clipping: the global norm counts each expert once). NVMe: both partitions' masters and states
    in one swapped optimizer, stepped tile by tile (sub_group_size 300: several tiles per partition)."""
    if offload == "nvme":
        offload = {"device": "nvme", "nvme_path": str(tmp_path), "zero": {"sub_group_size": 300}}
    elif offload == "cpu":
        offload = {"device": "cpu"}
    results = run_distributed(_engine_run, world, k, optimizer, False, stage, offload)
    for r in results:  # partition sizes: the ZeRO formula over each set's own group (x 1 chunk, padded to N)
        (dense, n_dense, psi_dense), (experts, n_exp, psi_exp) = r[3]
        assert (n_dense, n_exp) == (world, world // 2)
        assert dense == -(-psi_dense // world) and experts == -(-psi_exp // (world // 2))
        assert psi_exp == (E // 2) * (2 * (M * 2 * M) + 2 * M + M)  # this rank's E / ep experts
    _compare(results, *_reference(world, k, optimizer.removesuffix("-groups")))


def _compare(results, ref_steps, ref_params):
    for step, ref in enumerate(ref_steps):
        for rank, (steps, *_) in enumerate(results):
            loss, l_aux, counts = steps[step]
            assert counts == ref[rank][2], (step, rank)
            assert l_aux == pytest.approx(ref[rank][1], rel=1e-6), (step, rank)
            assert loss == pytest.approx(ref[rank][0], rel=1e-6), (step, rank)
    for rank, (_, params, *_) in enumerate(results):
        names = set(params)
        assert len(names) == len([n for n in ref_params if ".deepspeed_experts." not in n]) + \
            len([n for n in ref_params if ".deepspeed_experts." in n]) // 2
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {n}")


def _global_params(engine, ep: int, expert_rank: int | None = None) -> dict:
    """The engine's parameters under global expert names (local expert i -> ep_rank x E / ep + i; ep_rank
    default: consecutive ranks)."""
    out = {}
    ep_rank = expert_rank if expert_rank is not None else dist.get_rank() % ep
    for n, p in engine.module.named_parameters():
        if ".deepspeed_experts." in n and ep > 1:
            head, _, tail = n.partition(".deepspeed_experts.")
            i, _, rest = tail.partition(".")
            n = f"{head}.deepspeed_experts.{ep_rank * (E // ep) + int(i)}.{rest}"
        out[n] = p.detach().clone()
    return out


class _MegatronMpu:
    """A Megatron-style mpu (duck-typed, as `megatron.core.parallel_state`): tensor groups of tp consecutive
    ranks, data groups strided by tp. With tp 2 the model is not sharded: the two ranks of a tensor group
    are replicas fed the same micro-batches (as tests/dist/test_mesh.py's parity case)."""

    def __init__(self, tp: int):
        world = dist.get_world_size()
        self.tp, self.dp = tp, world // tp
        self.tensor = dist.new_subgroups_by_enumeration([list(range(i, i + tp)) for i in range(0, world, tp)])[0] \
            if tp > 1 else None
        self.data = dist.new_subgroups_by_enumeration([list(range(j, world, tp)) for j in range(tp)])[0] \
            if tp > 1 else dist.group.WORLD

    def get_data_parallel_group(self):
        return self.data

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank() // self.tp

    def get_model_parallel_group(self):
        return self.tensor


def _ranks(mesh, name: str) -> list[int]:
    """Global ranks of the mesh's `name` group (None: the world, or this rank alone at size 1)."""
    group = mesh.group(name)
    if group is not None:
        return dist.get_process_group_ranks(group)
    return [dist.get_rank()] if mesh.size(name) == 1 else list(range(dist.get_world_size()))


def _mpu_run(rank: int, world: int, tp: int, stage: int):
    """ep 2 under a user's mpu of tensor size tp: the expert groups carved from its data groups (DeepSpeed's
    E + M + D layout). Returns the steps, the parameters (global expert names) and the groups' ranks."""
    import zerospeed

    mpu = _MegatronMpu(tp)
    dp_rank = rank // tp
    torch.manual_seed(0)
    net = Net(2, 1, expert_rank=dp_rank % 2)
    engine, *_ = zerospeed.initialize(model=net, config=_config("adamw", stage), mpu=mpu)
    groups = (_ranks(engine.mesh, "expert"), _ranks(engine.mesh, "expert_data"))
    steps = []
    for batch in _data(world // tp):
        x, y = batch[dp_rank]
        loss, l_aux, counts = engine(x, y)
        engine.backward(loss)
        engine.step()
        steps.append((float(loss), float(l_aux), counts.tolist()))
    return steps, _global_params(engine, 2, dp_rank % 2), groups


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("stage", [0, 2])
def test_expert_parallel_under_a_users_mpu(tp, stage):
    """ep 2 inside world 4 with a Megatron-style mpu: tp 1 (dp 4: expert groups [0, 1], [2, 3], expert-data
    [0, 2], [1, 3], as without an mpu) trains as the world-4 run without one; tp 2 (data groups [0, 2], [1, 3],
    so ep = dp: the expert group is the data group) trains as the world-2 run without one, each tensor pair
    as its data rank. Losses, l_aux, routing and final weights bit for bit."""
    results = run_distributed(_mpu_run, 4, tp, stage)
    ref = run_distributed(_engine_run, 4 // tp, 1, "adamw", False, stage)
    for rank, (steps, params, (expert, expert_data)) in enumerate(results):
        if tp == 1:
            assert (expert, expert_data) == ([0, 1] if rank < 2 else [2, 3], [rank % 2, rank % 2 + 2])
        else:
            assert (expert, expert_data) == ([rank % 2, rank % 2 + 2], [rank])
        r_steps, r_params = ref[rank // tp][:2]
        assert steps == r_steps, rank
        assert params.keys() == r_params.keys()
        for n in params:
            assert torch.equal(params[n], r_params[n]), (rank, n)


def _checkpoint_run(rank: int, world: int, ep: int, mode: str, ckpt: str, stage: int = 0):
    """mode "save": 2 steps, save, a 3rd step; "resume": load, the 3rd step. Returns the 3rd step's loss and
    the parameters after it (global expert names)."""
    import zerospeed

    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(model=Net(ep, 2), config=_config("adamw", stage))
    batches = _data(world)
    if mode == "save":
        for x, y in (b[rank] for b in batches[:2]):
            engine.backward(engine(x, y)[0])
            engine.step()
        engine.save_checkpoint(ckpt, tag="t")
    else:
        engine.load_checkpoint(ckpt, tag="t")
    x, y = batches[2][rank]
    loss = engine(x, y)[0]
    engine.backward(loss)
    engine.step()
    try:
        engine.save_16bit_model(ckpt + "_16bit")
        refused = None
    except NotImplementedError as e:
        refused = str(e)
    return float(loss.detach()), _global_params(engine, ep), refused


def test_checkpoint_resumes_at_another_expert_parallel_size(tmp_path):
    """Saved at ep 2 (world 2), each expert under its global id: resumed at ep 2 and at ep 1 (every rank all
    experts) the next step equals the uninterrupted one; `to-fp32` holds every expert once."""
    from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_checkpoint_run, 2, 2, "save", ckpt)
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
    assert sorted(n for n in state if ".deepspeed_experts." in n) == sorted(
        f"moe.deepspeed_moe.experts.deepspeed_experts.{e}.{w}" for e in range(E) for w in
        ("0.weight", "0.bias", "2.weight", "2.bias"))
    assert saved[0][2] is None and saved[1][2] is None  # save_16bit_model gathers the experts
    uninterrupted = {**saved[1][1], **saved[0][1]}  # every expert, from the rank holding it
    assert len(uninterrupted) == len(state)
    from safetensors.torch import load_file

    weights = load_file(ckpt + "_16bit/model.safetensors")  # every expert under its global id, after step 3
    assert set(weights) == set(uninterrupted)
    for n, p in weights.items():
        torch.testing.assert_close(p, uninterrupted[n], rtol=0, atol=0, msg=n)
    for ep in (2, 1):
        resumed = run_distributed(_checkpoint_run, 2, ep, "resume", ckpt)
        for rank in range(2):
            assert resumed[rank][0] == pytest.approx(saved[rank][0], rel=1e-6), (ep, rank)
            assert len(resumed[rank][1]) == len(saved[rank][1]) + (len(state) - len(saved[rank][1])) * (ep == 1)
            for n, p in resumed[rank][1].items():
                torch.testing.assert_close(p, uninterrupted[n], rtol=1e-5, atol=1e-6, msg=f"ep {ep} rank {rank} {n}")


def test_zero2_checkpoint_resumes_at_other_sizes_and_stages(tmp_path):
    """Saved at ZeRO 2 and ep 2 (each rank writes its partition of the dense parameters and of its experts):
    resumed at (ep 2, stage 2), (ep 1, stage 1) and (ep 2, stage 0) the next step equals the uninterrupted one."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_checkpoint_run, 2, 2, "save", ckpt, 2)
    uninterrupted = {**saved[1][1], **saved[0][1]}
    for ep, stage in ((2, 2), (1, 1), (2, 0)):
        resumed = run_distributed(_checkpoint_run, 2, ep, "resume", ckpt, stage)
        for rank in range(2):
            assert resumed[rank][0] == pytest.approx(saved[rank][0], rel=1e-6), (ep, stage, rank)
            for n, p in resumed[rank][1].items():
                torch.testing.assert_close(p, uninterrupted[n], rtol=1e-5, atol=1e-6,
                                           msg=f"ep {ep} stage {stage} rank {rank} {n}")


class _TwoSizes(nn.Module):
    def __init__(self):
        from zerospeed.moe.layer import MoE

        super().__init__()
        self.a = MoE(M, nn.Linear(M, M), num_experts=4, ep_size=2)
        self.b = MoE(M, nn.Linear(M, M), num_experts=4, ep_size=4)


def test_bad_expert_parallel_configs():
    import zerospeed
    from zerospeed.config import ConfigError
    from zerospeed.moe.layer import MoE

    with pytest.raises(ConfigError, match=r"different ep_size values \[2, 4\]"):
        zerospeed.initialize(model=_TwoSizes(), config=_config("sgd"))
    cfg = dict(_config("sgd"), zero_optimization={"stage": 3})
    with pytest.raises(NotImplementedError, match="ep_size=2 at zero_optimization.stage=3 are not supported"):
        zerospeed.initialize(model=MoE(M, nn.Linear(M, M), num_experts=4, ep_size=2), config=cfg)


def _outside_engine(rank: int, world: int):
    from zerospeed.moe.layer import MoE

    torch.manual_seed(0)
    moe = MoE(M, nn.Linear(M, M), num_experts=4, ep_size=2, k=1, use_rts=False)
    moe.set_deepspeed_parallelism()  # DeepSpeed's call: consecutive ranks form the expert groups
    out, _, counts = moe(torch.randn(TOKENS, M, generator=torch.Generator().manual_seed(rank)))
    out.sum().backward()
    return dist.get_world_size(moe.deepspeed_moe.ep_group), int(counts.sum()), out.shape


def test_set_deepspeed_parallelism_outside_the_engine():
    assert run_distributed(_outside_engine, 2) == [(2, TOKENS, (TOKENS, M))] * 2


def _bf16_run(rank: int, world: int, ep: int, optimizer: str = "sgd", stage: int = 0):
    import zerospeed

    torch.manual_seed(0)
    cfg = dict(_config(optimizer, stage), bf16={"enabled": True})
    engine, *_ = zerospeed.initialize(model=Net(ep, 2), config=cfg)
    losses = []
    for batch in _data(world):
        x, y = batch[rank]
        loss = engine(x.bfloat16(), y.bfloat16())[0]
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses, {n: p.float() for n, p in _global_params(engine, ep).items()}, engine.get_global_grad_norm()


def test_bf16_expert_parallel_equals_every_expert_on_every_rank():
    """bf16 (2-byte buckets for the dense and the expert reducers, fp32 masters): ep 2 trains as ep 1 (every
    rank holds every expert, the ordinary reduction) at world 2, up to bf16 rounding (SGD: measured max weight
    difference 1e-3, one bf16 step at 0.3; AdamW turns such roundings of near-zero gradients into whole
    2 x lr steps, 0.019 on 0.8% of one tensor). The same at ZeRO 2 (2-byte reduce-scatter per set, fp32
    partitions of the masters)."""
    ep1 = run_distributed(_bf16_run, 2, 1)
    for stage in (0, 2):
        ep2 = run_distributed(_bf16_run, 2, 2, "sgd", stage)
        for rank in range(2):
            assert ep2[rank][0] == pytest.approx(ep1[rank][0], rel=1e-2), (stage, rank)  # one bf16 step of ~1.5: 0.0078
            for n, p in ep2[rank][1].items():
                torch.testing.assert_close(p, ep1[rank][1][n], rtol=1e-2, atol=3e-3, msg=f"stage {stage} rank {rank} {n}")


def _safe_get_run(rank: int, world: int, stage: int):
    """One step; the full gradient (after backward) and fp32 value (after the step) of an expert weight and a
    dense weight from `safe_get_full_*`, against this rank's own tensors."""
    import zerospeed
    from zerospeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(model=Net(2, 2), config=_config("sgd", stage))
    expert = engine.module.moe.deepspeed_moe.experts.deepspeed_experts[1][0].weight
    dense = engine.module.inp.weight
    x, y = _data(world)[0][rank]
    engine.backward(engine(x, y)[0])
    grads = [safe_get_full_grad(p).clone() for p in (expert, dense)]
    before = [p.detach().clone() for p in (expert, dense)]
    engine.step()
    # SGD lr 0.1: the step moved each weight by -0.1 x its full reduced gradient
    moved = [float((before[i] - 0.1 * grads[i] - p.detach()).abs().max()) for i, p in enumerate((expert, dense))]
    values = [float((safe_get_full_fp32_param(p) - p.detach()).abs().max()) for p in (expert, dense)]
    return moved, values, float(grads[0].abs().sum())


@pytest.mark.parametrize("stage", [0, 2])
def test_safe_get_full_of_an_expert_is_this_ranks_expert(stage):
    """`safe_get_full_fp32_param` / `safe_get_full_grad` of an expert parameter give this rank's expert (summed
    over its expert-data group only, as DeepSpeed's), of a dense one the data-parallel whole."""
    for moved, values, grad_sum in run_distributed(_safe_get_run, 2, stage):
        assert max(moved) < 1e-6 and max(values) == 0.0 and grad_sum > 0


# -- cross-check: DeepSpeed 0.19.8's MoE with the same script, when it is installed --------------------------
def _both_run(rank: int, world: int, stage: int):
    """DeepSpeed's and zerospeed's engines on the same model (their own MoE class), ep 2, SGD (a client
    optimizer over DeepSpeed's MoE param groups), no clipping: per-step losses and the weights after."""
    import importlib.util
    import logging

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
    import deepspeed
    from deepspeed.moe.layer import MoE as DSMoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import zerospeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    out = {}
    for name, lib, cls in (("deepspeed", deepspeed, DSMoE), ("zerospeed", zerospeed, None)):
        torch.manual_seed(0)
        net = Net(2, 2, moe_cls=cls)
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "p"})
        cfg = {k: v for k, v in _config("sgd", stage).items() if k not in ("optimizer", "comms_logger")}
        cfg.update(train_batch_size=TOKENS * world, zero_allow_untested_optimizer=True, steps_per_print=10**9)
        engine, *_ = lib.initialize(model=net, model_parameters=groups, optimizer=torch.optim.SGD(groups, lr=0.1),
                                    config=cfg)
        losses = []
        for batch in _data(world):
            x, y = batch[rank]
            loss = engine(x, y)[0]
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[name] = (losses, _global_params(engine, 2))
    return out


@pytest.mark.parametrize("stage", [0, 2])
def test_expert_parallel_matches_deepspeed(stage):
    """Same model, data and seed through DeepSpeed 0.19.8 and zerospeed at ep 2 (world 2): the same losses and
    weights (SGD without clipping; with clipping DeepSpeed's ZeRO 0 averages per-rank norms, a known defect)."""
    for rank, out in enumerate(run_distributed(_both_run, 2, stage, timeout=600, env={"DS_ACCELERATOR": "cpu"})):
        ds, zs = out["deepspeed"], out["zerospeed"]
        assert zs[0] == pytest.approx(ds[0], rel=1e-6), (rank, zs[0], ds[0])
        assert set(zs[1]) == set(ds[1])
        for n, p in zs[1].items():
            torch.testing.assert_close(p, ds[1][n], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {n} {m}")


def _ckpt_act_run(rank: int, world: int, recompute: bool):
    """ep 2, the MoE layer inside `zerospeed.checkpointing.checkpoint` (its all-to-alls re-run in backward) or not:
    per-step losses and this rank's parameters after 3 AdamW steps with clipping."""
    import zerospeed
    from zerospeed.checkpointing import checkpoint

    torch.manual_seed(0)
    net = Net(2, 2)
    if recompute:
        inner = net.moe

        class Recomputed(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return checkpoint(self.inner, x)

        net.moe = Recomputed()
    engine, *_ = zerospeed.initialize(model=net, config=_config("adamw", 2))
    losses = []
    for batch in _data(world):
        x, y = batch[rank]
        loss = engine(x, y)[0]
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in engine.module.parameters()], \
        engine.comms_logger.stats["all_to_all"].calls


def test_activation_checkpointing_of_an_expert_parallel_layer():
    """Recomputing the MoE layer in backward (its dispatch and combine all-to-alls run again, in the same order on
    every rank) trains exactly as without recomputation at ep 2, ZeRO 2."""
    plain, recomputed = run_distributed(_ckpt_act_run, 2, False), run_distributed(_ckpt_act_run, 2, True)
    for (a_losses, a_params, a_calls), (b_losses, b_params, b_calls) in zip(plain, recomputed):
        assert (a_calls, b_calls) == (4 * STEPS, 6 * STEPS)  # the forward's two all-to-alls again in backward
        assert a_losses == b_losses
        assert all(torch.equal(a, b) for a, b in zip(a_params, b_params))
