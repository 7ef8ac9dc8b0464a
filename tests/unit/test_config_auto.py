"""zerospeed.config: the Hugging Face Trainer's "auto" values, derived from the model or refused (issue 17)."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from zerospeed.config import ConfigError, ModelHints, load_config, model_hints
from zerospeed.testing.models import GPT, GPTConfig

BASE = {"train_micro_batch_size_per_gpu": 2}
HIDDEN_AUTO = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
               "stage3_param_persistence_threshold": "auto"}


def error(source, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, **kwargs)
    return str(info.value)


def zero(stage, model, **extra):
    return load_config({**BASE, "zero_optimization": {"stage": stage, **HIDDEN_AUTO, **extra}}, model=model
                       ).zero_optimization


class HFStyle(nn.Module):
    """A module with an HF-style ``config`` object (only the attribute matters)."""

    def __init__(self, **config):
        super().__init__()
        self.config = types.SimpleNamespace(**config)
        self.lin = nn.Linear(4, 4)


# ---------------------------------------------------------------------------- hidden-size keys


@pytest.mark.parametrize("hidden, expected", [
    (64, (4096, 3686, 640)),          # 64**2, int(0.9 * 64**2), 10 * 64
    (768, (589824, 530841, 7680)),
    (4096, (16777216, 15099494, 40960)),
])
def test_stage3_hidden_size_keys_follow_hf_formulas(hidden, expected):
    z = zero(3, HFStyle(hidden_size=hidden))
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == expected
    # resolved values count as set, so the engine uses them (not the 25 MiB DDP default)
    assert {"reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold"} <= z.model_fields_set


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_below_stage3_only_reduce_bucket_size_is_derived(stage):
    z = zero(stage, HFStyle(hidden_size=64))
    assert z.reduce_bucket_size == 4096  # HF fills it at every stage
    assert (z.prefetch_bucket_size, z.param_persistence_threshold) == (50_000_000, 100_000)  # defaults, unused


@pytest.mark.parametrize("config, source", [
    ({"hidden_size": 64}, "model.config.hidden_size"),
    ({"hidden_sizes": [32, 64, 16]}, "model.config.hidden_sizes"),  # the largest, as HF
    ({"text_config": types.SimpleNamespace(hidden_size=64)}, "model.config.text_config.hidden_size"),
    ({"d_model": 64}, "model.config.d_model"),
    ({"n_embd": 64}, "model.config.n_embd"),
    ({"hidden_size": 64, "d_model": 8}, "model.config.hidden_size"),  # HF's name wins
])
def test_hidden_size_sources(config, source):
    hints = model_hints(HFStyle(**config))
    assert (hints.hidden_size, hints.hidden_size_source) == (64, source)
    assert zero(3, HFStyle(**config)).reduce_bucket_size == 4096


def test_hidden_size_from_a_transformers_config_and_zerospeeds_gpt():
    transformers = pytest.importorskip("transformers")
    model = HFStyle()
    model.config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2)  # hidden_size maps to n_embd
    assert zero(3, model).reduce_bucket_size == 4096
    gpt = GPT(GPTConfig(seq_len=8, n_layer=1, n_head=2, d_model=48))  # zerospeed's GPT keeps .cfg
    assert model_hints(gpt).hidden_size_source == "model.cfg.d_model"
    assert zero(3, gpt).param_persistence_threshold == 480


def test_hidden_size_auto_without_a_model_is_an_error_naming_the_key():
    msg = error({**BASE, "zero_optimization": {"stage": 3, **HIDDEN_AUTO}})
    for key, formula in (("reduce_bucket_size", "hidden_size**2"),
                         ("stage3_prefetch_bucket_size", "int(0.9 * hidden_size**2)"),
                         ("stage3_param_persistence_threshold", "10 * hidden_size")):
        assert f"zero_optimization.{key}: is 'auto', which the Hugging Face Trainer fills with {formula}" in msg
    assert "no model was given to load_config" in msg and "pass model= to load_config" in msg
    assert "set an integer number of elements" in msg and "3 problems" in msg


def test_hidden_size_auto_with_a_model_without_config_is_an_error():
    msg = error({**BASE, "zero_optimization": {"reduce_bucket_size": "auto"}}, model=nn.Linear(64, 64))
    assert "zero_optimization.reduce_bucket_size: is 'auto'" in msg
    assert "Linear has no .config to read hidden_size, d_model or n_embd from" in msg
    assert "PyTorch DDP's 25 MiB buckets" in msg and "pass model=" not in msg
    msg = error({**BASE, "zero_optimization": {"reduce_bucket_size": "auto"}}, model=HFStyle(vocab_size=5))
    assert "model.config has no hidden_size, hidden_sizes" in msg


def test_stage3_only_keys_need_no_model_below_stage3():
    z = load_config({**BASE, "zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto",
                                                  "stage3_param_persistence_threshold": "auto"}}).zero_optimization
    assert (z.prefetch_bucket_size, z.param_persistence_threshold) == (50_000_000, 100_000)


def test_explicit_values_and_model_hints_object():
    z = load_config({**BASE, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                                  "prefetch_bucket_size": "auto"}},
                    model=ModelHints(hidden_size=10)).zero_optimization
    assert (z.reduce_bucket_size, z.prefetch_bucket_size) == (1000, 90)


# ---------------------------------------------------------------------------- stage


@pytest.mark.parametrize("model", [None, HFStyle(hidden_size=64)])
def test_stage_auto_is_an_error_naming_the_key_and_valid_values(model):
    msg = error({**BASE, "zero_optimization": {"stage": "auto"}}, model=model)
    assert "zero_optimization.stage: 'auto' is not a ZeRO stage" in msg
    assert "set 0 (plain data parallel), 1 (optimizer states partitioned), 2 (+ gradients) or 3" in msg
    assert "silently run stage 0" in msg


# ---------------------------------------------------------------------------- precision, clipping, scheduler


@pytest.mark.parametrize("dtype, expected", [(None, (False, False)), (torch.float32, (False, False)),
                                             (torch.bfloat16, (False, True)), (torch.float16, (True, False))])
def test_fp16_bf16_enabled_auto_follows_the_models_dtype(dtype, expected):
    model = nn.Linear(4, 4).to(dtype) if dtype is not None else None
    c = load_config({**BASE, "fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"}}, model=model)
    assert (c.fp16.enabled, c.bf16.enabled) == expected


def test_precision_auto_yields_to_an_explicit_choice():
    c = load_config({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": "auto"}},
                    model=nn.Linear(4, 4).to(torch.bfloat16))
    assert (c.fp16.enabled, c.bf16.enabled) == (True, False)


def test_gradient_clipping_auto_is_hfs_default_max_grad_norm():
    assert load_config({**BASE, "gradient_clipping": "auto"}).gradient_clipping == 1.0


@pytest.mark.parametrize("type_", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_scheduler_warmup_num_steps_auto_is_an_error(type_):
    msg = error({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                 "scheduler": {"type": type_, "params": {"warmup_num_steps": "auto", "total_num_steps": 100}}})
    assert "scheduler.params.warmup_num_steps: is 'auto'" in msg and "set the number of warm-up optimizer steps" in msg


def test_hf_zero3_template_with_a_model():
    """HF's ZeRO-3 template with what only the Trainer knows filled in; the model supplies the rest."""
    client = torch.optim.AdamW([nn.Parameter(torch.zeros(3))], lr=2e-5)
    c = load_config({
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": 1}},
        "zero_optimization": {"stage": 3, **HIDDEN_AUTO},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": 4,
    }, dp_world_size=2, client_optimizer=client, model=HFStyle(hidden_size=64))
    z = c.zero_optimization
    assert (c.train_batch_size, c.precision, c.gradient_clipping) == (8, "fp32", 1.0)
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (4096, 3686, 640)
    assert c.scheduler.kwargs()["warmup_max_lr"] == 2e-5
