"""The batch triple: DeepSpeed's derivation rules, without silent flooring."""
from __future__ import annotations

import pytest

from zerospeed.config import BatchSizes, ConfigError, load_config, resolve_batch

TB, MB, GA = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


# DeepSpeed repo/tests/unit/runtime/test_ds_config_dict.py::TestBatchConfig, world size 2
@pytest.mark.parametrize(
    "batch,micro_batch,gas,success",
    [(32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False), (32, 18, 1, False)],
)
def test_deepspeed_batch_config_cases(batch, micro_batch, gas, success):
    cfg = {TB: batch, MB: micro_batch, GA: gas}
    if success:
        loaded = load_config(cfg, dp_world_size=2)
        assert (loaded.train_batch_size, loaded.train_micro_batch_size_per_gpu,
                loaded.gradient_accumulation_steps) == (batch, micro_batch, gas)
    else:
        with pytest.raises(ConfigError, match="batch sizes do not fit"):
            load_config(cfg, dp_world_size=2)


@pytest.mark.parametrize(
    "given,dp,expected",
    [
        ((32, 16, 1), 2, (32, 16, 1)),  # all three: checked only
        ((32, 4, None), 2, (32, 4, 4)),  # tb, mb -> ga
        ((32, None, 4), 2, (32, 4, 4)),  # tb, ga -> mb
        ((None, 4, 4), 2, (32, 4, 4)),  # mb, ga -> tb
        ((32, None, None), 2, (32, 16, 1)),  # tb -> ga = 1, mb = tb / dp
        ((None, 8, None), 4, (32, 8, 1)),  # mb -> ga = 1, tb = mb * dp
        ((8, None, None), 1, (8, 8, 1)),
    ],
)
def test_derivation_rules(given, dp, expected):
    assert resolve_batch(*given, dp) == BatchSizes(*expected)
    assert all(type(v) is int for v in resolve_batch(*given, dp))


def test_mismatch_message_shows_numbers_dp_and_two_completions():
    with pytest.raises(ConfigError) as info:
        resolve_batch(33, 17, 2, 2)
    msg = str(info.value)
    assert "train_batch_size=33" in msg and "= 68" in msg and "dp_world_size=2" in msg
    assert "set train_batch_size=68" in msg
    assert "set train_batch_size=34 and gradient_accumulation_steps=1" in msg


def test_mismatch_completion_keeps_train_batch_size_when_possible():
    with pytest.raises(ConfigError) as info:
        resolve_batch(32, 18, 1, 2)
    msg = str(info.value)
    assert "set train_batch_size=36" in msg
    assert "set train_micro_batch_size_per_gpu=16" in msg


@pytest.mark.parametrize("given,dp,fragment", [
    ((33, 17, None), 2, "is not a multiple of train_micro_batch_size_per_gpu 17 x dp 2 = 34"),
    ((30, None, 4), 2, "is not a multiple of gradient_accumulation_steps 4 x dp 2 = 8"),
    ((33, None, None), 2, "is not a multiple of dp 2"),
])
def test_no_silent_floor(given, dp, fragment):
    with pytest.raises(ConfigError) as info:
        resolve_batch(*given, dp)
    assert fragment in str(info.value)
    assert "Consistent choices: set" in str(info.value)


@pytest.mark.parametrize("given", [(None, None, None), (None, None, 4)])
def test_neither_batch_nor_micro_batch(given):
    with pytest.raises(ConfigError, match="Either train_batch_size or train_micro_batch_size_per_gpu"):
        resolve_batch(*given, 2)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "32"])
def test_bad_values(bad):
    with pytest.raises(ConfigError, match="positive integer"):
        resolve_batch(bad, None, None, 1)


def test_integral_float_accepted():
    assert resolve_batch(32.0, None, None, 2) == (32, 16, 1)


@pytest.mark.parametrize("dp", [0, -1, 1.5, True])
def test_bad_dp_world_size(dp):
    with pytest.raises(ConfigError, match="dp_world_size"):
        resolve_batch(32, None, None, dp)
    with pytest.raises(ConfigError, match="dp_world_size"):
        load_config({TB: 32}, dp_world_size=dp)


def test_auto_batch_fields_are_derived():
    cfg = load_config({TB: "auto", MB: 4, GA: "auto"}, dp_world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 1)
    cfg = load_config({TB: 64, MB: "auto", GA: 4}, dp_world_size=2)
    assert cfg.train_micro_batch_size_per_gpu == 8


def test_all_auto_batch_is_an_error_saying_what_to_set():
    with pytest.raises(ConfigError, match="set train_micro_batch_size_per_gpu"):
        load_config({TB: "auto", MB: "auto", GA: "auto"}, dp_world_size=2)


def test_resolved_dp_world_size_is_recorded():
    cfg = load_config({MB: 2, GA: 3}, dp_world_size=4)
    assert cfg.train_batch_size == 24 and cfg.dp_world_size == 4
