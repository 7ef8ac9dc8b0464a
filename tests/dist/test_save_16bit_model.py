"""`engine.save_16bit_model` on real gloo ranks: both file kinds hold the full weights at stages 0 and 3,
a write that fails on rank 0 raises on every rank without a hang, and at stage 3 the save gathers
units one at a time and leaves them as it found them (released, or still gathered when pinned by
`GatheredParameters`). One launch runs every case."""
from pathlib import Path

import pytest
import torch

import zerospeed
from zerospeed.testing.models import random_tokens, tiny_gpt
from zerospeed.testing.spawn import run_distributed

IDX = random_tokens(2, 16, seed=3)[:, :16]


def _config(stage: int) -> dict:
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero}


def _fail_after(n: int):
    """A write_safetensors that reads n tensors and then fails, as a full disk would."""
    def write(path, entries, **kwargs):
        for i, entry in enumerate(entries):
            if i == n:
                raise OSError("No space left on device (injected)")
            entry[3]()
    return write


def rank_body(rank, world, root):
    from safetensors.torch import load_file

    import zerospeed.runtime.consolidate as consolidate
    from zerospeed.zero.stage3_params import ParamStatus

    out = {}
    for stage in (0, 3):
        engine, *_ = zerospeed.initialize(model=tiny_gpt(seed=0), config=_config(stage))
        d = Path(root) / f"stage{stage}"
        engine.save_16bit_model(d, "weights.pt")
        engine.save_16bit_model(d, "weights.safetensors")
        full = engine.strategy.consolidated_state_dict() if stage == 3 else \
            {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        res = {}
        if rank == 0:
            pt = torch.load(d / "weights.pt", weights_only=True)
            st = load_file(str(d / "weights.safetensors"))
            res["keys"] = (sorted(pt), sorted(st), sorted(full))
            res["equal"] = all(torch.equal(pt[k], full[k]) and torch.equal(st[k], full[k]) for k in full)
        write = consolidate.write_safetensors
        consolidate.write_safetensors = _fail_after(3)
        try:
            engine.save_16bit_model(d / "failed", "weights.safetensors")
        except Exception as exc:  # noqa: BLE001 - the test reads it
            res["raised"] = (type(exc).__name__, str(exc))
        finally:
            consolidate.write_safetensors = write
        if stage == 3:
            units = engine.strategy.units
            res["released"] = all(u.status is ParamStatus.SHARDED for u in units)
            pinned = [sp.param for sp in units[1].params]
            with zerospeed.zero.GatheredParameters(pinned):
                engine.save_16bit_model(d, "again.safetensors")
                res["pinned_kept"] = units[1].status is ParamStatus.GATHERED
            res["released_after"] = all(u.status is ParamStatus.SHARDED for u in units)
        engine.eval()
        with torch.no_grad():
            res["logits_finite"] = bool(torch.isfinite(engine(IDX)).all())
        engine.destroy()
        out[stage] = res
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(rank_body, 2, str(tmp_path_factory.mktemp("save16")), timeout=120)


@pytest.mark.parametrize("stage", [0, 3])
def test_both_formats_hold_the_full_weights(results, stage):
    pt_keys, st_keys, full_keys = results[0][stage]["keys"]
    assert pt_keys == st_keys == full_keys
    assert results[0][stage]["equal"]


@pytest.mark.parametrize("stage", [0, 3])
def test_failed_write_on_rank_0_raises_on_every_rank(results, stage):
    kind, msg = results[0][stage]["raised"]
    assert kind == "OSError" and "injected" in msg  # the writer's own exception
    kind, msg = results[1][stage]["raised"]
    assert kind == "CheckpointError" and "rank 0" in msg and "injected" in msg
    assert all(r[stage]["logits_finite"] for r in results)  # the engine still runs (no unit left half-done)


def test_stage3_units_left_as_found(results):
    for r in results:
        assert r[3]["released"] and r[3]["pinned_kept"] and r[3]["released_after"]
