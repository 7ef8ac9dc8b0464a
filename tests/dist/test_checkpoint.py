"""Checkpoints on real gloo ranks: exact resume (every stage), resharding to other world sizes and stages,
crash safety (a writer raising, a rank SIGKILLed mid-save), damaged files, another model, tag checks."""
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import zerospeed
import zerospeed.runtime.checkpoint as ckpt_mod
from zerospeed.runtime.checkpoint import CheckpointTagMismatchError
from zerospeed.runtime.checkpoint_format import CheckpointError, CheckpointMismatchError, read_index
from zerospeed.testing.models import random_tokens, tiny_gpt
from zerospeed.testing.parity import global_batches, max_rel_diff, train_engine
from zerospeed.testing.spawn import RankFailure, run_distributed

LOSS_TOL = 1e-6  # relative, continued losses after resharding (only the summation order differs; at 4
# ranks test_zero3.py measures stage 0 and 3 within 1e-6 of plain PyTorch on losses, weights 5e-4)
SCHED = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 8,
                                             "total_num_steps": 40}}


# fp16 starting at 2**18 overflows first (skipped steps, the scale halves), then grows every 3 clean steps
PRECISION = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
             "fp16": {"fp16": {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 3}}}


def config(stage, micro=2, gas=1, precision="fp32"):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}, "scheduler": SCHED,
            "steps_per_print": 1000, "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000,
                                                        "stage3_param_persistence_threshold": 0},
            **PRECISION[precision]}


def batches(world_batch=4, steps=20):
    return global_batches(random_tokens(world_batch * steps, 64, seed=1), world_batch, steps)


def train_loader(engine, it, steps):
    """Train on the engine-built loader; per-step loss averaged over micro-batches and ranks."""
    losses = []
    for _ in range(steps):
        total = torch.zeros((), dtype=torch.float64)
        for _ in range(engine.gradient_accumulation_steps()):
            rows = next(it)[0]
            loss = engine(rows[:, :-1], rows[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        dist.all_reduce(total)
        losses.append(float(total) / (engine.gradient_accumulation_steps() * dist.get_world_size()))
    return losses


# -- exact resume ------------------------------------------------------------------------------------------
def exact_resume(rank, world, root, stage, gas, use_loader, precision="fp32"):
    """10 steps, save, 10 more; a fresh engine (other initial weights) loads and trains the same 10."""
    path = Path(root) / f"resume-s{stage}-{precision}"
    data = TensorDataset(random_tokens(96, 32, seed=2)) if use_loader else None
    steps = batches(4 * gas)

    def build(seed):
        engine, _, loader, _ = zerospeed.initialize(model=tiny_gpt(seed=seed, dropout=0.1),
                                                    config=config(stage, gas=gas, precision=precision),
                                                    training_data=data)
        return engine, (iter(loader) if use_loader else None)

    def run(engine, it, part, scales=None):
        if use_loader:
            return train_loader(engine, it, 10)
        return train_engine(engine, steps[part], on_step=lambda e: scales.append(e.loss_scale) if scales is not None
                            else None)

    engine, it = build(0)
    run(engine, it, slice(0, 10))
    engine.save_checkpoint(path, client_state={"epoch": 3, "note": ("a", 1), "t": torch.arange(4)})
    scale_at_save = (engine.loss_scale, engine.skipped_steps)
    scales_after, scales_resumed = [], []
    after = run(engine, it, slice(10, 20), scales_after)
    facts = (engine.global_steps, engine.global_samples, engine.get_lr(), engine.loss_scale, engine.skipped_steps)
    engine.destroy()
    fresh, it = build(7)
    load_path, client = fresh.load_checkpoint(path)
    resumed = run(fresh, it if it is None else iter(fresh.training_dataloader), slice(10, 20), scales_resumed)
    fresh_facts = (fresh.global_steps, fresh.global_samples, fresh.get_lr(), fresh.loss_scale, fresh.skipped_steps)
    out = {"after": after, "resumed": resumed, "facts": facts, "client": client, "load_path": load_path,
           "scale_at_save": scale_at_save, "scales": (scales_after, scales_resumed), "fresh_facts": fresh_facts}
    fresh.destroy()
    if stage == 0:  # control: the same load with the RNG re-seeded afterwards gives other losses (dropout)
        control, it = build(7)
        control.load_checkpoint(path)
        torch.manual_seed(1234)
        out["control"] = run(control, it, slice(10, 20))
        control.destroy()
    return out


# -- resharding: saved at 2 ranks with stage 3 ----------------------------------------------------------------
def reshard_save(rank, world, root):
    engine, *_ = zerospeed.initialize(model=tiny_gpt(seed=0), config=config(3))
    train_engine(engine, batches()[:10])
    engine.save_checkpoint(Path(root) / "reshard")
    saved = engine.strategy.consolidated_state_dict()
    reference = train_engine(engine, batches()[10:])  # the run that never changed size
    engine.destroy()
    return saved, reference


def reshard_load(rank, world, root, stage):
    """Load the stage-3 / 2-rank checkpoint here (keeping the global batch at 4), then train 10 steps."""
    engine, *_ = zerospeed.initialize(model=tiny_gpt(seed=3), config=config(stage, micro=4 // world))
    engine.load_checkpoint(Path(root) / "reshard")
    loaded = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    steps = engine.global_steps
    losses = train_engine(engine, batches()[10:])
    engine.destroy()
    return loaded, steps, losses


# -- crash safety, damaged files, wrong model, tags --------------------------------------------------------
def _expect(exc_type, fn, *args, **kwargs):
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    return str(info.value)


def failure_checks(rank, world, root):
    root = Path(root)
    good = root / "crash"
    engine, *_ = zerospeed.initialize(model=tiny_gpt(seed=0), config=config(2))
    train_engine(engine, batches()[:2])
    engine.save_checkpoint(good)
    train_engine(engine, batches()[2:3])
    out = {}

    def boom(path, *a, **k):  # rank 1's writer fails; rank 0 has written its file by then
        raise OSError(28, "No space left on device")
    original = ckpt_mod.write_safetensors
    ckpt_mod.write_safetensors = boom if rank == 1 else original
    try:
        out["writer"] = _expect(CheckpointError if rank == 0 else OSError, engine.save_checkpoint, good)
    finally:
        ckpt_mod.write_safetensors = original
    out["after_writer"] = ((good / "latest").read_text(), sorted(os.listdir(good)))

    engine.checkpoint_tag_validation = "Fail"
    out["tag_fail"] = _expect(CheckpointTagMismatchError, engine.save_checkpoint, root / "tags", tag=f"t{rank}")
    engine.checkpoint_tag_validation = "Warn"  # the default: an error too (DeepSpeed only warns)
    out["tag_warn_error"] = _expect(CheckpointTagMismatchError, engine.save_checkpoint, root / "tags", tag=f"w{rank}")
    engine.checkpoint_tag_validation = "Ignore"
    engine.save_checkpoint(root / "tags", tag=f"w{rank}")  # saves under rank 0's tag
    out["tag_warn"] = ((root / "tags" / "latest").read_text(), sorted(os.listdir(root / "tags")))
    out["no_latest"] = engine.load_checkpoint(root / "nothing-here")

    damaged = {}
    for kind in ("truncated", "missing", "corrupt"):
        where = root / kind
        if rank == 0:
            shutil.copytree(good, where)
            victim = where / "global_step2" / f"zs_rank0000{1 if kind != 'corrupt' else 0}.safetensors"
            if kind == "truncated":
                os.truncate(victim, victim.stat().st_size - 100)
            elif kind == "missing":
                victim.unlink()
            else:  # flip one byte of the first fragment (rank 0 reads its own fragments whole: CRC-checked)
                with open(victim, "r+b") as f:
                    f.seek(8 + int.from_bytes(f.read(8), "little") + 10)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        damaged[kind] = _expect(CheckpointError, engine.load_checkpoint, where)
    out["damaged"] = damaged
    engine.destroy()

    other, *_ = zerospeed.initialize(model=tiny_gpt(seed=0, d_model=32, n_layer=3), config=config(1))
    out["wrong_model"] = _expect(CheckpointMismatchError, other.load_checkpoint, good)
    other.destroy()
    deeper, *_ = zerospeed.initialize(model=tiny_gpt(seed=0, n_layer=3), config=config(3))
    out["strict"] = _expect(CheckpointMismatchError, deeper.load_checkpoint, good)
    deeper.load_checkpoint(good, load_module_strict=False)  # loads the matching keys
    out["non_strict_step"] = deeper.global_steps
    deeper.destroy()
    # a crash while re-saving the same tag can leave the old copy aside: it is still found
    dist.barrier()
    if rank == 0:
        os.replace(good / "global_step2", good / "global_step2.old-zs0badc0de")
    dist.barrier()
    again, *_ = zerospeed.initialize(model=tiny_gpt(seed=1), config=config(2))
    out["aside"] = again.load_checkpoint(good)[0]
    again.destroy()
    return out


def extras_check(rank, world, root):
    """A frozen parameter and a persistent buffer: saved from stage 3, loaded into stage 1 and back into
    the saving engine after another step."""
    def model(seed):
        m = tiny_gpt(seed=seed)
        m.wpe.weight.requires_grad_(False)
        m.register_buffer("calibration", torch.arange(5.0) + seed)
        m.register_buffer("scratch", torch.zeros(3), persistent=False)
        return m
    a, *_ = zerospeed.initialize(model=model(0), config=config(3))
    train_engine(a, batches()[:2])
    a.save_checkpoint(Path(root) / "extras")
    saved = a.strategy.consolidated_state_dict()
    train_engine(a, batches()[2:3])
    a.load_checkpoint(Path(root) / "extras")  # the same ZeRO-3 engine, right after saving (DeepSpeed cannot)
    same_engine = a.strategy.consolidated_state_dict()
    a.destroy()
    b, *_ = zerospeed.initialize(model=model(9), config=config(1))
    b.load_checkpoint(Path(root) / "extras")
    loaded = b.module.state_dict()
    b.destroy()
    return all(torch.equal(saved[k], loaded[k]) and torch.equal(saved[k], same_engine[k]) for k in saved) \
        and saved.keys() == loaded.keys() == same_engine.keys()


def world2_all(rank, world, root):
    out = {f"resume{s}": exact_resume(rank, world, root, s, gas, loader)
           for s, gas, loader in ((0, 1, False), (1, 2, False), (2, 1, True), (3, 1, False))}
    out["resume-bf16"] = exact_resume(rank, world, root, 3, 1, False, "bf16")
    out["resume-fp16"] = exact_resume(rank, world, root, 1, 1, False, "fp16")
    out["reshard_save"] = reshard_save(rank, world, root)
    out["reshard_load"] = reshard_load(rank, world, root, 1)
    out["failures"] = failure_checks(rank, world, root)
    out["extras"] = extras_check(rank, world, root)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def world2(root):
    return run_distributed(world2_all, 2, str(root), timeout=240)


@pytest.mark.parametrize("stage", [0, 1, 2, 3, "-bf16", "-fp16"])
def test_exact_resume_is_bitwise(world2, stage):
    """fp32 at stages 0-3 (stage 1 with gradient accumulation, stage 2 on the engine's data loader),
    bf16 at stage 3, fp16 at stage 1 with a loss scale that overflows and grows around the save."""
    for r in world2:
        res = r[f"resume{stage}"]
        assert res["resumed"] == res["after"], stage  # bitwise: float equality of every loss
        assert res["fresh_facts"] == res["facts"]  # global_steps, global_samples, lr after 20 steps
        client = res["client"]
        assert client.keys() == {"epoch", "note", "t"} and client["epoch"] == 3 and client["note"] == ("a", 1)
        assert torch.equal(client["t"], torch.arange(4))
        assert res["load_path"].endswith("global_step10")
    if stage == 0:
        assert world2[0]["resume0"]["control"] != world2[0]["resume0"]["after"]  # the RNG states matter
    if stage == "-fp16":  # the scaler's state matters: steps were skipped before the save, the scale moves after
        res = world2[0]["resume-fp16"]
        after, resumed = res["scales"]
        assert res["scale_at_save"][1] > 0 and len(set(after)) > 1 and after == resumed


def _check_reshard(saved, reference, loaded, steps, losses):
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)  # bit-identical weights right after load
    assert steps == 10
    assert max_rel_diff(losses, reference) < LOSS_TOL, (losses, reference)


def test_reshard_stage3_world2_to_stage1_world2(world2):
    saved, reference = world2[0]["reshard_save"]
    for r in world2:
        _check_reshard(saved, reference, *r["reshard_load"])


def test_reshard_stage3_world2_to_stage0_world1_and_stage2_world4(world2, root):
    saved, reference = world2[0]["reshard_save"]
    for world, stage in ((1, 0), (4, 2)):
        for r in run_distributed(reshard_load, world, str(root), stage, timeout=180):
            _check_reshard(saved, reference, *r)


def test_failed_write_and_damaged_files_and_wrong_model(world2):
    for rank, r in enumerate(world2):
        f = r["failures"]
        assert "No space left on device" in f["writer"] and ("rank 1" in f["writer"] or rank == 1)
        assert f["after_writer"] == ("global_step2", ["global_step2", "latest"])  # nothing else left behind
        assert "rank 0: 't0'" in f["tag_fail"] and "rank 1: 't1'" in f["tag_fail"]
        assert "rank 0: 'w0'" in f["tag_warn_error"]
        assert f["tag_warn"] == ("w0", ["latest", "w0"])
        assert f["no_latest"] == (None, None)
        assert "zs_rank00001.safetensors" in f["damaged"]["truncated"] and "truncated" in f["damaged"]["truncated"]
        assert "zs_rank00001.safetensors" in f["damaged"]["missing"] and "missing" in f["damaged"]["missing"]
        assert "zs_rank00000.safetensors" in f["damaged"]["corrupt"] and "CRC" in f["damaged"]["corrupt"]
        assert "wte.weight: checkpoint [256, 64] vs model [256, 32]" in f["wrong_model"]
        assert "missing in the checkpoint" in f["strict"] and "blocks.2.fc.weight" in f["strict"]
        assert f["non_strict_step"] == 2 and f["aside"].endswith("global_step2.old-zs0badc0de")
        assert r["extras"]


def sigkill_body(rank, world, root):
    engine, *_ = zerospeed.initialize(model=tiny_gpt(seed=0), config=config(1))
    train_engine(engine, batches()[:2])
    engine.save_checkpoint(Path(root) / "kill")
    train_engine(engine, batches()[2:3])
    if rank == 1:
        original = ckpt_mod.write_safetensors

        def write_then_die(*a, **k):
            original(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt_mod.write_safetensors = write_then_die
    engine.save_checkpoint(Path(root) / "kill")


def load_after_kill(rank, world, root):
    engine, *_ = zerospeed.initialize(model=tiny_gpt(seed=4), config=config(0, micro=4))
    path, _ = engine.load_checkpoint(Path(root) / "kill")
    losses = train_engine(engine, batches()[2:4])
    return path, engine.global_steps, losses


def test_rank_killed_mid_save_leaves_previous_checkpoint(root):
    with pytest.raises(RankFailure, match="rank 1 exited with code -9"):
        run_distributed(sigkill_body, 2, str(root), timeout=60)
    kill = Path(root) / "kill"
    assert (kill / "latest").read_text() == "global_step2"
    assert not (kill / "global_step3").exists() and any(".tmp-zs" in p.name for p in kill.iterdir())
    assert read_index(kill / "global_step2")["world_size"] == 2
    path, steps, losses = run_distributed(load_after_kill, 1, str(root))[0]
    assert path.endswith("global_step2") and steps == 4 and all(x == x for x in losses)
