"""The device mesh on real gloo ranks: DeepSpeed's rank order, the named sub-groups, the mpu interface, and
ZeRO running over the data-parallel sub-group only.

The parity case: ZeRO 0-3 with an explicit mesh (tensor-parallel size 2, the model *not* sharded, so the two
ranks of a tensor group are replicas fed the same micro-batches) inside world 4 has data-parallel size 2,
so its losses, gradient norms and final weights must equal a world-2 run bit for bit: the same
collectives over a 2-rank sub-group, the same summation order. A ZeRO layer that reduced over the world
(dividing by 4, or mixing the replicas) or broadcast from a wrong source would show.
"""
import pytest
import torch
import torch.distributed as dist

import zerospeed
from zerospeed.parallel import MpuError, ParallelMesh
from zerospeed.testing.models import random_tokens, tiny_gpt
from zerospeed.testing.parity import global_batches, train_engine
from zerospeed.testing.spawn import run_distributed

STEPS = 4
CASES = [(0, 0.0), (1, 0.05), (2, 0.0), (3, 0.05)]  # (ZeRO stage, gradient clipping)


def _members(group) -> list[int]:
    """Global ranks of `group` as seen by this rank (an all-gather over the group itself)."""
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t) for t in out]


def mesh_groups(rank, world):
    res = {}
    m = ParallelMesh.build(tp=2)
    res["tp2"] = {"data": _members(m.group("data")), "tensor": _members(m.group("tensor")),
                  "model": _members(m.group("model")), "dp": (m.get_data_parallel_rank(), m.get_data_parallel_world_size()),
                  "tp": (m.get_tensor_model_parallel_rank(), m.get_tensor_model_parallel_world_size()),
                  "src": m.get_tensor_model_parallel_src_rank(), "pipe": m.get_pipeline_model_parallel_world_size()}
    m = ParallelMesh.build(tp=2, pp=2)
    res["tp2pp2"] = {"pipe": _members(m.group("pipe")), "tensor": _members(m.group("tensor")),
                     "model": _members(m.group("model")), "dp": m.get_data_parallel_world_size(),
                     "coord": tuple(m.topology.get_coord(rank))}
    m = ParallelMesh.build()
    res["dp_only"] = (m.group("data") is None, m.get_data_parallel_world_size(), m.get_model_parallel_world_size())
    with pytest.raises(ValueError, match="not divisible"):
        ParallelMesh.build(tp=3)

    class Partial:
        def get_data_parallel_group(self):
            return None

    with pytest.raises(MpuError, match="get_data_parallel_world_size.*get_model_parallel_group"):
        ParallelMesh.from_mpu(Partial())
    return res


def test_mesh_groups_follow_deepspeed_rank_order():
    res = run_distributed(mesh_groups, 4)
    for rank, r in enumerate(res):
        # PipeModelDataParallelTopology: tensor innermost -> tensor groups are adjacent ranks
        assert r["tp2"]["tensor"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["tp2"]["data"] == [rank % 2, rank % 2 + 2]
        assert r["tp2"]["model"] == r["tp2"]["tensor"]
        assert r["tp2"]["dp"] == (rank // 2, 2) and r["tp2"]["tp"] == (rank % 2, 2)
        assert r["tp2"]["src"] == rank - rank % 2 and r["tp2"]["pipe"] == 1
        assert r["tp2pp2"]["coord"] == (rank // 2, 0, rank % 2)  # (pipe, data, model)
        assert r["tp2pp2"]["pipe"] == [rank % 2, rank % 2 + 2]
        assert r["tp2pp2"]["model"] == [0, 1, 2, 3] and r["tp2pp2"]["dp"] == 1
        assert r["dp_only"] == (True, 4, 1)


def expert_groups(rank, world):
    res = {}
    m = ParallelMesh.build(ep=2)
    res["dp4ep2"] = {"expert": _members(m.group("expert")), "expert_data": _members(m.group("expert_data")),
                     "ep": (m.get_expert_parallel_rank(), m.get_expert_parallel_world_size()),
                     "edp": (m.get_expert_data_parallel_rank(), m.get_expert_data_parallel_world_size()),
                     "size": (m.size("expert"), m.rank("expert_data")), "data": m.group("data") is None,
                     "same": (m.get_expert_parallel_group() is m.group("expert"),
                              m.get_expert_data_parallel_group() is m.group("expert_data"))}
    m = ParallelMesh.build(tp=2, ep=2)  # ep = dp: the expert group is the data group
    res["tp2ep2"] = {"expert": _members(m.group("expert")), "is_data": m.group("expert") is m.group("data"),
                     "edp": (m.group("expert_data"), m.get_expert_data_parallel_world_size(),
                             m.get_expert_data_parallel_rank())}
    m = ParallelMesh.build()
    res["ep1"] = (m.group("expert"), m.get_expert_parallel_world_size(), m.get_expert_data_parallel_world_size(),
                  m.get_expert_data_parallel_rank())
    with pytest.raises(ValueError, match="ep=3 does not divide the data-parallel size dp=4"):
        ParallelMesh.build(ep=3)
    return res


def test_expert_groups_carved_from_data_as_deepspeed():
    """dp 4, ep 2: expert groups [0, 1], [2, 3] (consecutive data ranks), expert-data groups [0, 2], [1, 3]."""
    res = run_distributed(expert_groups, 4)
    for rank, r in enumerate(res):
        a = r["dp4ep2"]
        assert a["expert"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert a["expert_data"] == [rank % 2, rank % 2 + 2]
        assert a["ep"] == (rank % 2, 2) and a["edp"] == (rank // 2, 2)
        assert a["size"] == (2, rank // 2) and a["data"] and a["same"] == (True, True)
        b = r["tp2ep2"]
        assert b["expert"] == [rank % 2, rank % 2 + 2] and b["is_data"]
        assert b["edp"] == (None, 1, 0)
        assert r["ep1"] == (None, 1, 4, rank)


def _config(stage, clip):
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "comms_logger": {"enabled": True},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 0}}


def zero_runs(rank, world, tp):
    mesh = ParallelMesh.build(tp=tp) if tp > 1 else None
    out = {}
    for stage, clip in CASES:
        model = tiny_gpt(seed=0, bias=False)
        engine, *_ = zerospeed.initialize(model=model, config=_config(stage, clip), mpu=mesh)
        assert engine.dp_world_size == 2 and engine.train_batch_size() == 4
        assert dist.get_world_size(engine.strategy.group) == 2 and engine.mp_world_size == tp
        batches = global_batches(random_tokens(4 * STEPS, 64, seed=1), 4, STEPS)
        norms = []
        losses = train_engine(engine, batches, on_step=lambda e: norms.append(e.get_global_grad_norm()))
        with zerospeed.zero.GatheredParameters(list(model.parameters())) if stage == 3 else _null():
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mem = engine.strategy.memory_breakdown()
        stats = engine.comms_logger.stats
        out[stage] = {"losses": losses, "norms": norms, "state": state, "memory": mem,
                      "elements": {k: v.elements for k, v in stats.items()}}
        engine.destroy()
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_zero_over_data_parallel_subgroup_equals_world_2():
    """World 4 = (data 2) x (tensor 2, replicas) gives exactly the numbers of world 2, at ZeRO 0-3."""
    ref = run_distributed(zero_runs, 2, 1)
    res = run_distributed(zero_runs, 4, 2)
    for rank in range(4):
        dp_rank = rank // 2
        for stage, _ in CASES:
            a, b = res[rank][stage], ref[dp_rank][stage]
            assert a["losses"] == b["losses"], (rank, stage)
            assert a["norms"] == b["norms"], (rank, stage)
            for k in b["state"]:
                assert torch.equal(a["state"][k], b["state"][k]), (rank, stage, k)
            # the same bytes per rank and the same elements communicated over the data-parallel group
            assert a["memory"] == b["memory"], (rank, stage)
            assert a["elements"] == b["elements"], (rank, stage)


def checkpoint_round_trip(rank, world, save_dir):
    mesh = ParallelMesh.build(tp=2)
    batches = global_batches(random_tokens(4 * 4, 64, seed=1), 4, 4)

    def engine():
        model = tiny_gpt(seed=0, bias=False)
        return zerospeed.initialize(model=model, config=_config(2, 0.0), mpu=mesh)[0]

    a = engine()
    train_engine(a, batches[:2])
    a.save_checkpoint(save_dir)
    after = train_engine(a, batches[2:])
    b = engine()
    b.load_checkpoint(save_dir)
    resumed = train_engine(b, batches[2:])
    with pytest.raises(NotImplementedError, match="model parallelism"):
        b.save_16bit_model(save_dir)
    return after, resumed, sorted(p.name for p in __import__("pathlib").Path(save_dir).iterdir())


def test_checkpoint_per_model_rank_round_trip(tmp_path):
    res = run_distributed(checkpoint_round_trip, 4, str(tmp_path))
    for after, resumed, listing in res:
        assert resumed == after  # the same next losses after the reload
        assert listing == ["mp_rank_00", "mp_rank_01"]


def fp16_overflow_runs(rank, world, tp):
    """fp16 from a loss scale of 2**32: the first steps overflow and are skipped, on every rank alike."""
    mesh = ParallelMesh.build(tp=tp) if tp > 1 else None
    cfg = _config(1, 1.0)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 32, "loss_scale_window": 2}
    model = tiny_gpt(seed=0, bias=False)
    engine, *_ = zerospeed.initialize(model=model, config=cfg, mpu=mesh)
    losses = train_engine(engine, global_batches(random_tokens(4 * 6, 64, seed=1), 4, 6))
    return losses, engine.skipped_steps, engine.loss_scale


def test_overflow_vote_with_model_parallel_ranks():
    ref = run_distributed(fp16_overflow_runs, 2, 1)
    res = run_distributed(fp16_overflow_runs, 4, 2)
    assert ref[0][1] > 0  # steps were skipped
    for rank in range(4):
        assert res[rank] == ref[rank // 2]
