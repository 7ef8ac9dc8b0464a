"""`zerospeed.tp_model_init` + `zerospeed.initialize` trains exactly as the config's AutoTP path.

World 2, tiny HF Llama (grouped-query attention): the model sharded by `tp_model_init(model, 2, fp32)` and
then given to `initialize` without `tensor_parallel.autotp_size` (and, separately, with the same size)
must give the per-step losses and gradient norms of `initialize` with `"autotp_size": 2` on the unmodified
model, bit for bit (same broadcast from rank 0, same shards, same collectives), at ZeRO 0 and 3 with AdamW
and clipping; the mesh is tp_model_init's (no second set of groups). Conflicts are ConfigErrors.
"""
import pytest
import torch
import torch.distributed as dist

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.tensor_parallel import tensor_parallel_layers
from zerospeed.testing.models import random_tokens, tiny_hf_llama
from zerospeed.testing.parity import train_lm_engine
from zerospeed.testing.spawn import run_distributed

pytest.importorskip("transformers")

STEPS, MICRO, SEQ = 4, 2, 32


def _config(stage, autotp=None, **extra):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}
    if autotp is not None:
        cfg["tensor_parallel"] = {"autotp_size": autotp}
    return cfg


def _batches():
    tokens = random_tokens(MICRO * STEPS, SEQ, seed=1)[:, :SEQ]
    return [(tokens[i:i + MICRO], None) for i in range(0, MICRO * STEPS, MICRO)]


def _train(engine):
    norms = []
    losses = []
    for batch in _batches():
        losses += train_lm_engine(engine, [batch])
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def runs(rank, world):
    out = {}
    for stage in (0, 3):
        engine, *_ = zerospeed.initialize(model=tiny_hf_llama(seed=0), config=_config(stage, autotp=2))
        out[("autotp", stage)] = _train(engine)
        engine.destroy()
        for autotp in (None, 2):
            model = zerospeed.tp_model_init(tiny_hf_llama(seed=0), tp_size=2, dtype=torch.float32)
            layers = [layer for _, layer in tensor_parallel_layers(model)]
            engine, *_ = zerospeed.initialize(model=model, config=_config(stage, autotp=autotp))
            assert engine.mesh.group("tensor") is layers[0].group  # tp_model_init's mesh, not a new one
            assert engine.dp_world_size == 1 and engine.train_batch_size() == MICRO
            out[(autotp, stage)] = _train(engine)
            engine.destroy()

    errors = {}
    model = zerospeed.tp_model_init(tiny_hf_llama(seed=0), 2, torch.float32)
    for name, kwargs in {"size": dict(config=_config(0, autotp=4)),
                         "mpu": dict(config=_config(0), mpu=zerospeed.parallel.ParallelMesh.build())}.items():
        with pytest.raises(ConfigError) as exc:
            zerospeed.initialize(model=model, **kwargs)
        errors[name] = str(exc.value)
    with pytest.raises(ValueError, match="already sharded"):
        zerospeed.tp_model_init(model, 2, torch.float32)
    with pytest.raises(ValueError, match="conflicts with the config's tensor_parallel.autotp_size=4"):
        zerospeed.tp_model_init(tiny_hf_llama(seed=0), 2, torch.float32, config=_config(0, autotp=4))
    with pytest.raises(TypeError, match="tp_group cannot be given"):
        zerospeed.tp_model_init(tiny_hf_llama(seed=0), 2, torch.float32, tp_group=None)
    bf16 = zerospeed.tp_model_init(tiny_hf_llama(seed=0), 2, torch.bfloat16)
    with pytest.raises(ConfigError) as exc:
        zerospeed.initialize(model=bf16, config=_config(0))
    errors["dtype"] = str(exc.value)
    engine, *_ = zerospeed.initialize(model=bf16, config=_config(1, bf16={"enabled": True}))
    out["bf16"] = _train(engine)[0]
    engine.destroy()
    return out, errors


def test_tp_model_init_trains_as_autotp():
    for rank, (out, errors) in enumerate(run_distributed(runs, 2, timeout=300)):
        for stage in (0, 3):
            ref = out[("autotp", stage)]
            assert out[(None, stage)] == ref, (rank, stage)  # losses and norms, bit for bit
            assert out[(2, stage)] == ref, (rank, stage)
        assert "autotp_size=4 conflicts with tp_model_init(tp_size=2)" in errors["size"]
        assert "do not pass mpu" in errors["mpu"]
        assert 'torch.bfloat16' in errors["dtype"] and '"bf16": {"enabled": true}' in errors["dtype"]
        assert all(torch.isfinite(torch.tensor(out["bf16"])))


def test_tp_model_init_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        zerospeed.tp_model_init(torch.nn.Linear(4, 4), 2, torch.float32)
