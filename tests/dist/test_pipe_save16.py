"""`engine.save_16bit_model` from a pipeline engine on real gloo ranks, at pp 2 (world 2) and pp 2 x dp 2 (world 4),
fp32 (ZeRO 1) and bf16 (ZeRO 2), SGD, a weight tied between the first and the last stage and a frozen bias, both
file kinds: after 2 steps global rank 0's one file holds every stage's tensors once under the global names, in
the module dtype, bit-equal to every rank's own parameters and buffers; it loads strictly into the model built
at one stage; a one-stage engine trained the same way writes the same keys and values (to the tolerance of a
different summation order), and one that loaded the pipeline's checkpoint writes the same file, byte for byte;
exclude_frozen_parameters drops the frozen bias; a write failing on rank 0 mid-file raises on every rank without
a hang, and the next save still works. One launch per world size runs every case.
"""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerospeed
from zerospeed.pipe import PipelineModule
from zerospeed.testing.spawn import run_distributed
from test_pipe_checkpoint import GLOBAL, _batches
from test_pipe_engine import MICRO, OPTIMIZERS, _layers
from test_save_16bit_model import _fail_after

STEPS, OPT = 2, "sgd"
PRECISIONS = {"fp32": (torch.float32, 1), "bf16": (torch.bfloat16, 2)}  # dtype, ZeRO stage
FROZEN = "2.bias"
FAIL_AFTER = (2, 4)  # entries read before the write fails: 3 of stage 0's come first, then 2 of stage 1's
NAMES = ["tied_modules.embed.weight", "2.weight", "2.bias", "4.weight", "4.bias"]


def _engine(num_stages, precision):
    dtype, stage = PRECISIONS[precision]
    module = PipelineModule(_layers("tied"), num_stages=num_stages, loss_fn=nn.MSELoss(), seed_layers=True,
                            partition_method="uniform")
    frozen = dict(module.named_parameters()).get(FROZEN)
    if frozen is not None:
        frozen.requires_grad_(False)
    dp = dist.get_world_size() // num_stages
    engine, *_ = zerospeed.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GLOBAL // (MICRO * dp),
        "optimizer": OPTIMIZERS[OPT][0], "gradient_clipping": OPTIMIZERS[OPT][1],
        "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == torch.bfloat16}})
    it = iter([(x.to(dtype), y.to(dtype)) for x, y in _batches(dp, dist.get_rank(engine.group), STEPS)])
    for _ in range(STEPS):
        engine.train_batch(it)
    return engine


def rank_body(rank, world, root):
    import zerospeed.runtime.consolidate_pipe as consolidate_pipe

    out = {}
    for precision in PRECISIONS:
        d = Path(root) / precision
        engine = _engine(2, precision)
        for name in ("model.safetensors", "model.bin"):
            engine.save_16bit_model(d / "pipe", name)
        engine.save_16bit_model(d / "pipe", "trainable.safetensors", exclude_frozen_parameters=True)
        res = {"state": {n: t.detach().clone() for n, t in engine.module.state_dict().items()}}
        write = consolidate_pipe.write_safetensors
        for n in FAIL_AFTER:
            consolidate_pipe.write_safetensors = _fail_after(n)
            try:
                engine.save_16bit_model(d / "failed", "model.safetensors")
            except Exception as exc:  # noqa: BLE001 - the test reads it
                res.setdefault("raised", []).append((type(exc).__name__, str(exc)))
            finally:
                consolidate_pipe.write_safetensors = write
        engine.save_16bit_model(d / "pipe", "again.safetensors")  # no message of the failed save is left over
        engine.save_checkpoint(d / "ckpt", tag="t")
        engine.destroy()
        one = _engine(1, precision)  # the same training at one stage (dp = world)
        one.save_16bit_model(d / "one", "trained.safetensors")
        one.load_checkpoint(d / "ckpt", tag="t")  # the pipeline's weights, exactly
        for name in ("loaded.safetensors", "loaded.bin"):
            one.save_16bit_model(d / "one", name)
        one.destroy()
        out[precision] = res
    return out


def _check(results, root, world):
    from safetensors.torch import load_file

    for precision, (dtype, _) in PRECISIONS.items():
        d = Path(root) / precision
        st = load_file(str(d / "pipe" / "model.safetensors"))
        pt = torch.load(d / "pipe" / "model.bin", weights_only=True)
        assert sorted(st) == sorted(pt) == sorted(NAMES), (precision, sorted(st))
        assert all(st[k].dtype == dtype and torch.equal(st[k], pt[k]) for k in st)
        for rank, res in enumerate(results):  # (a) every rank's own tensors, tied copies on both stages included
            for k, v in res[precision]["state"].items():
                assert v.dtype == dtype and torch.equal(st[k], v), (world, precision, rank, k)
        trainable = load_file(str(d / "pipe" / "trainable.safetensors"))
        assert sorted(trainable) == sorted(set(NAMES) - {FROZEN})
        again = d / "pipe" / "again.safetensors"
        assert again.read_bytes() == (d / "pipe" / "model.safetensors").read_bytes()
        assert not (d / "failed" / "model.safetensors").exists() and not list((d / "failed").glob(".*tmp*"))
        for rank, res in enumerate(results):
            assert len(res[precision]["raised"]) == len(FAIL_AFTER)
            for kind, msg in res[precision]["raised"]:
                assert kind == ("OSError" if rank == 0 else "CheckpointError") and "injected" in msg, (rank, kind, msg)
                assert rank == 0 or "rank 0" in msg
        module = PipelineModule(_layers("tied"), num_stages=1, loss_fn=nn.MSELoss(), partition_method="uniform",
                                stage_id=0).to(dtype)
        module.load_state_dict(st, strict=True)
        assert all(torch.equal(v, st[k]) for k, v in module.state_dict().items())
        trained = load_file(str(d / "one" / "trained.safetensors"))  # (b) trained at one stage
        assert sorted(trained) == sorted(st)
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding step (1/256 of the largest weight)
        for k in st:
            err = float((trained[k].float() - st[k].float()).abs().max() / st[k].float().abs().max())
            assert err < tol, (world, precision, k, err)
        for name in ("safetensors", "bin"):  # the same weights at one stage: the same file
            a, b = d / "pipe" / f"model.{name}", d / "one" / f"loaded.{name}"
            if name == "safetensors":
                assert a.read_bytes() == b.read_bytes(), precision
            else:
                x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
                assert list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_save_16bit_model(world, tmp_path):
    _check(run_distributed(rank_body, world, str(tmp_path), timeout=120), tmp_path, world)
