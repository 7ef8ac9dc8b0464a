"""Loss scaling and the precision policy, one process: DeepSpeed's `test_dynamic_loss_scale.py` cases
(`tests/unit/runtime/half_precision/`) replayed on `DynamicLossScaler.update_scale`, plus the error at
the minimum scale, state dicts and the rate-limited skip log."""
import logging

import pytest
import torch
from torch import nn

from zerospeed.config import load_config
from zerospeed.precision import (DynamicLossScaler, LossScaleAtMinimumError, LossScaler, MixedPrecisionPolicy,
                                 SkipLog, StaticLossScaler, build_loss_scaler)

INF, NAN = float("inf"), float("nan")


def run(scaler, overflows):
    """update_scale for each overflow flag; returns the scale after each call."""
    scales = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        scales.append(scaler.loss_scale)
    return scales


def scaler_from(fp16):
    return build_loss_scaler(load_config({"train_batch_size": 1, "fp16": {"enabled": True, **fp16}}).fp16)


def test_no_overflow_doubles_every_window():
    """TestFused.test_no_overflow: power 8, window 2: the scale doubles after each 2 clean iterations."""
    s = scaler_from({"loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2})
    assert isinstance(s, DynamicLossScaler) and s.loss_scale == 2**8 and s.scale_window == 2
    expected = 2**8
    for i in range(10):
        s.update_scale(False)
        assert s.loss_scale == expected and s.cur_iter == i + 1
        if s.cur_iter % 2 == 0:
            expected *= 2


def test_all_overflow_halves_down_to_the_minimum_then_raises():
    """TestFused/TestUnfused.test_all_overflow (hysteresis 1): 16 -> 8 -> 4 -> 2 (min_loss_scale 2). At
    the minimum DeepSpeed's ZeRO scaler raises (its stage-0 fp16 optimizer clamps); we raise, naming
    the parameters."""
    s = scaler_from({"loss_scale": 0, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1,
                     "min_loss_scale": 2})
    assert run(s, [True] * 3) == [8, 4, 2] and s.cur_iter == 3
    with pytest.raises(LossScaleAtMinimumError) as err:
        s.update_scale(True, nonfinite_names=lambda: ["blocks.0.fc.weight", "wte.weight"])
    msg = str(err.value)
    assert "blocks.0.fc.weight, wte.weight" in msg and "min_loss_scale=2" in msg and '"bf16"' in msg
    assert s.loss_scale == 2


def test_some_overflow():
    """test_some_overflow: two overflows halve twice; window + 1 clean iterations double once; one more
    overflow halves."""
    s = scaler_from({"loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1})
    assert run(s, [True, True]) == [2**7, 2**6] and s.cur_iter == 2
    assert run(s, [False] * 3)[-1] == 2**7 and s.cur_iter == 5
    assert run(s, [True]) == [2**6] and s.cur_iter == 6


def test_hysteresis_absorbs_overflows_then_halves_each():
    """TestZeroStage0Hysteresis.test_hysteresis: hysteresis 3: two overflows absorbed, then each halves
    (the counter is not refilled by halving)."""
    s = DynamicLossScaler(init_scale=2**8, hysteresis=3)
    assert run(s, [True] * 4) == [2**8, 2**8, 2**7, 2**6]
    assert s.cur_hysteresis == 1


def test_window_refills_hysteresis_and_consecutive_hysteresis_refills_at_once():
    s = DynamicLossScaler(init_scale=2**8, hysteresis=2, scale_window=2)
    assert run(s, [True, False, False, False]) == [2**8, 2**8, 2**8, 2**9]  # doubled after 2 clean since
    assert s.cur_hysteresis == 2  # ... and the window refilled the hysteresis
    s = DynamicLossScaler(init_scale=2**8, hysteresis=2, consecutive_hysteresis=True)
    assert run(s, [True, False] * 4)[-1] == 2**8  # isolated overflows never lower the scale
    s = DynamicLossScaler(init_scale=2**8, hysteresis=2)
    assert run(s, [True, False, True]) == [2**8, 2**8, 2**7]  # without it the second overflow halves


def test_state_dict_round_trip_keeps_hysteresis_spent():
    """test_hysteresis_survives_a_checkpoint: one overflow spent, the next one is the last absorbed."""
    s = DynamicLossScaler(init_scale=2**8, hysteresis=3)
    s.update_scale(True)
    restored = DynamicLossScaler(init_scale=2**8, hysteresis=3)
    restored.load_state_dict(s.state_dict())
    assert restored.cur_hysteresis == 2 and restored.cur_iter == 1 and restored.last_overflow_iter == 0
    assert run(restored, [True, True]) == [2**8, 2**7]
    static = StaticLossScaler(128.0)
    assert run(static, [True, False]) == [128.0, 128.0] and static.state_dict()["cur_scale"] == 128.0


def test_build_from_config_and_scale():
    assert isinstance(scaler_from({"loss_scale": 512}), StaticLossScaler)
    s = scaler_from({})
    assert (s.loss_scale, s.scale_window, s.min_scale, s.hysteresis) == (2**16, 1000, 1.0, 2)
    assert not s.consecutive_hysteresis
    off = build_loss_scaler(load_config({"train_batch_size": 1, "bf16": {"enabled": True}}).fp16)
    loss = torch.tensor(3.0)
    assert type(off) is LossScaler and off.scale(loss) is loss and s.scale(loss).item() == 3.0 * 2**16
    with pytest.raises(ValueError, match="min_scale"):
        DynamicLossScaler(min_scale=0)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_skip_log_is_rate_limited():
    log, logger, seen = SkipLog(rank=0, every=10), logging.getLogger("zerospeed.precision"), _Records()
    logger.addHandler(seen)  # the "zerospeed" logger may not propagate to the root (setup_logger)
    try:
        written = [log.skipped(step=i, total_skipped=i + 1, old_scale=2.0, new_scale=1.0, fp16=True)
                   for i in range(25)]
    finally:
        logger.removeHandler(seen)
    assert [i for i, w in enumerate(written) if w] == [0, 10, 20] and len(seen.records) == 3
    assert "loss scale 2 -> 1" in seen.records[0].getMessage()
    assert not SkipLog(rank=1).skipped(step=0, total_skipped=1, old_scale=1, new_scale=1, fp16=False)


def test_policy_from_precision_and_cast_keeps_originals():
    assert MixedPrecisionPolicy.from_precision("fp32") == MixedPrecisionPolicy()
    bf16 = MixedPrecisionPolicy.from_precision("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.master_dtype) == (torch.bfloat16,) * 2 + (torch.float32,)
    fp16 = MixedPrecisionPolicy.from_precision("fp16", "fp32")  # DeepSpeed: communication_data_type wins
    assert fp16.reduce_dtype == torch.float32 and fp16.mixed and fp16.name == "fp16"
    with pytest.raises(ValueError, match="master_dtype"):
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, master_dtype=torch.bfloat16)
    model = nn.BatchNorm1d(3)
    model.weight.data = torch.tensor([1.0 + 2**-12, 2.0, 3.0])
    weight = model.weight
    originals = bf16.cast_module(model)
    assert model.weight is weight and weight.dtype == torch.bfloat16 and model.running_mean.dtype == torch.bfloat16
    assert model.num_batches_tracked.dtype == torch.long  # integer buffers untouched
    assert originals[id(weight)].dtype == torch.float32 and originals[id(weight)][0].item() == 1.0 + 2**-12
    assert MixedPrecisionPolicy().cast_module(model) == {}
