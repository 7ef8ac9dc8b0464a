"""Flops profiler: exact FLOP/MAC/param counts, the printed report, MFU arithmetic."""
import math

import pytest
import torch
from torch import nn

from zerospeed.profiling import (FlopsProfiler, get_model_profile, macs_to_string, measure_matmul_peak_flops,
                                 number_to_string, params_to_string)
from zerospeed.profiling.format import duration_to_string, flops_to_string
from zerospeed.testing.models import Block, tiny_gpt

PEAK_TFLOPS = 1.0  # a given peak keeps these tests from benchmarking the machine


def gpt_forward_flops(batch: int, seq: int, d: int, n_layer: int, vocab: int) -> int:
    """Forward FLOPs of zerospeed.testing.models.GPT as FlopCounterMode counts them.

    Per token and layer: qkv 2*d*3d = 6d^2, attention out-proj 2d^2, MLP 2*d*4d*2 = 16d^2
    (together 24 d^2), plus attention scores QK^T and the weighted sum of V, 2*t*d each = 4*t*d
    (t = sequence length; SDPA is counted in full, the causal mask does not halve it). The LM
    head adds 2*d*V per token. Embeddings, norms, GELU, softmax and bias adds are not counted.
    """
    per_token = n_layer * (24 * d * d + 4 * seq * d) + 2 * d * vocab
    return batch * seq * per_token


def test_linear_exact_flops_macs_params():
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    x = torch.randn(20, 32)
    flops, macs, params = get_model_profile(lin, args=[x], print_profile=False, as_string=False)
    assert flops == 2 * 32 * 48 * 20 == 61_440
    assert macs == 32 * 48 * 20
    assert params == 32 * 48 + 48


def test_gpt_forward_flops_match_formula():
    model = tiny_gpt(0, n_layer=3)
    cfg = model.cfg
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    flops, macs, params = get_model_profile(model, args=[idx], print_profile=False, as_string=False)
    expected = gpt_forward_flops(4, cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.vocab_size)
    assert flops == pytest.approx(expected, rel=0.01)
    assert flops == expected  # in fact exact: every counted op is in the formula
    assert macs == flops // 2
    assert params == cfg.num_params()


def test_lenet5_matches_deepspeed_macs_and_params():
    # DeepSpeed's tests/unit/profiling/flops_profiler/test_flops_profiler.py: batch 1024 of 1x32x32
    # gives 426,516,480 MACs, 61,706 params and 866,076,672 FLOPs. DeepSpeed's FLOPs add estimates
    # for tanh, pooling, softmax and conv biases; ours count matmul/conv work only (2 per MAC).
    model = nn.Sequential(
        nn.Conv2d(1, 6, 5), nn.Tanh(), nn.AvgPool2d(2), nn.Conv2d(6, 16, 5), nn.Tanh(), nn.AvgPool2d(2),
        nn.Conv2d(16, 120, 5), nn.Tanh(), nn.Flatten(), nn.Linear(120, 84), nn.Tanh(), nn.Linear(84, 10))
    flops, macs, params = get_model_profile(model, input_shape=(1024, 1, 32, 32), print_profile=False,
                                            as_string=False)
    assert macs == 426_516_480
    assert params == 61_706
    assert flops == 2 * macs == 853_032_960
    assert abs(flops - 866_076_672) / 866_076_672 < 0.016
    strings = get_model_profile(model, input_shape=(4, 1, 32, 32), print_profile=False)  # as_string=True
    assert strings == ("3.33 M", "1.67 MMACs", "61.71 K")  # 4/1024 of the above


def test_printed_profile_names_every_block(tmp_path, capsys):
    model = tiny_gpt(0, n_layer=3)
    idx = torch.randint(0, 256, (2, 64))
    out_file = tmp_path / "sub" / "profile.txt"
    get_model_profile(model, args=[idx], top_modules=2, output_file=str(out_file), peak_tflops=PEAK_TFLOPS)
    text = out_file.read_text()
    assert capsys.readouterr().out == ""  # went to the file only
    expected = gpt_forward_flops(2, 64, 64, 3, 256)
    for label in ("params per device:", "fwd MACs per device:", "fwd flops per device:", "fwd latency:",
                  "fwd FLOPS per device", "fwd MFU", "Aggregated Profile", "Detailed Profile", "depth 2:"):
        assert label in text
    assert number_to_string(expected) in text
    for i in range(3):
        assert f"blocks.{i}: Block(" in text
        assert f"blocks.{i}.attn.qkv: Linear(" in text
    per_block = 2 * 64 * (24 * 64 * 64 + 4 * 64 * 64)
    block_params = sum(p.numel() for p in model.blocks[0].parameters())
    assert f"blocks.0: Block({params_to_string(block_params)} = " in text
    assert macs_to_string(per_block // 2) in text
    # not detailed: no tree, aggregated classes only
    brief = FlopsProfiler(model, peak_tflops=PEAK_TFLOPS)
    brief.start_profile()
    model(idx)
    brief.stop_profile()
    short = brief.print_model_profile(detailed=False, module_depth=2)
    brief.end_profile()
    assert "blocks.0:" not in short and "depth 1:" in short and "depth 2:" not in short


def test_training_window_counts_forward_only_and_resets():
    model = tiny_gpt(0, n_layer=2).train()
    idx = torch.randint(0, 256, (2, 64))
    one = gpt_forward_flops(2, 64, 64, 2, 256)
    prof = FlopsProfiler(model, recompute_fwd_factor=1.0, peak_tflops=PEAK_TFLOPS)
    prof.start_profile()
    loss = model(idx, idx)
    prof.stop_profile()
    loss.backward()  # after stop_profile: not counted
    assert prof.get_total_flops() == one
    assert prof.get_total_macs() == one // 2
    per_module = prof.get_module_profile()
    assert per_module["blocks.1"].flops == 2 * 64 * (24 * 64 * 64 + 4 * 64 * 64)
    assert per_module["lm_head"].flops == 2 * 2 * 64 * 64 * 256
    assert per_module["blocks"].duration == pytest.approx(
        per_module["blocks.0"].duration + per_module["blocks.1"].duration)
    assert prof.get_total_duration() > 0
    mfu = prof.get_mfu()
    assert mfu == pytest.approx(one / prof.get_total_duration() / 1e12)
    assert prof.get_mfu(iter_latency=0.5) == pytest.approx(4.0 * one / 0.5 / 1e12)  # (3 + 1) x fwd
    text = prof.print_model_profile(profile_step=7, fwd_latency=0.1, bwd_latency=0.3, step_latency=0.1)
    assert "Profile Summary at step 7:" in text
    assert flops_to_string(3 * one / 0.3) in text  # bwd FLOPS = (2 + 1) * fwd flops / bwd latency
    assert f"{100 * 4 * one / 0.5 / 1e12:.2f} %" in text  # MFU over the whole iteration
    assert duration_to_string(0.5) in text  # iter latency
    prof.reset_profile()
    assert prof.get_total_flops() == 0
    prof.start_profile()
    model(idx)
    model(idx)
    prof.stop_profile()
    assert prof.get_total_flops() == 2 * one  # a window accumulates over calls
    prof.end_profile()
    assert not prof.started
    assert prof.print_model_profile() == ""


def test_ignore_list_removes_module_flops():
    model = tiny_gpt(0, n_layer=2)
    idx = torch.randint(0, 256, (2, 64))
    flops, _, _ = get_model_profile(model, args=[idx], print_profile=False, as_string=False, ignore_modules=[Block])
    assert flops == 2 * 2 * 64 * 64 * 256  # only the LM head is left


def test_engine_fields_and_errors():
    class FakeEngine:
        world_size, dp_world_size, mp_world_size = 2, 2, 1

        def train_micro_batch_size_per_gpu(self):
            return 4

    lin = nn.Linear(8, 8)
    prof = FlopsProfiler(lin, ds_engine=FakeEngine(), peak_tflops=PEAK_TFLOPS)
    prof.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        prof.start_profile()
    lin(torch.randn(4, 8))
    prof.stop_profile()
    text = prof.print_model_profile(fwd_latency=0.01, bwd_latency=0.02, step_latency=0.01)
    assert "data parallel size: " in text and "batch size per device: " in text
    assert "samples/second: " in text and str(round(4 * 2 / 0.04, 2)) in text
    prof.end_profile()
    with pytest.raises(TypeError):
        FlopsProfiler("not a module")
    with pytest.raises(ValueError, match="recompute_fwd_factor"):
        FlopsProfiler(lin, recompute_fwd_factor=-1)
    with pytest.raises(ValueError, match="input_shape, args or kwargs"):
        get_model_profile(lin)
    with pytest.raises(ValueError, match="mode"):
        get_model_profile(lin, input_shape=(2, 8), mode="backward")


def test_generate_mode_and_training_flag_restored():
    model = tiny_gpt(0).train()
    idx = torch.randint(0, 256, (1, 8))
    flops, _, _ = get_model_profile(model, args=[idx], kwargs={"max_new_tokens": 2}, mode="generate",
                                    print_profile=False, as_string=False)
    # two decoding steps on 8 then 9 tokens, each a full forward of the context
    assert flops == gpt_forward_flops(1, 8, 64, 2, 256) + gpt_forward_flops(1, 9, 64, 2, 256)
    assert model.training


def test_number_formats_and_peak():
    assert number_to_string(866_076_672) == "866.08 M"
    assert number_to_string(0) == "0 "
    assert params_to_string(61_706) == "61.71 K"
    assert params_to_string(7e9) == "7 B"
    assert macs_to_string(426_516_480) == "426.52 MMACs"
    assert flops_to_string(2.5e12) == "2.5 TFLOPS"
    assert duration_to_string(0.0123) == "12.3 ms"
    with pytest.raises(ValueError):
        number_to_string(1.0, units="X")
    peak = measure_matmul_peak_flops(n=128, repeats=1, min_seconds=0.01)
    assert math.isfinite(peak) and peak > 1e6  # any machine does > 1 MFLOP/s
    with pytest.raises(ValueError):
        measure_matmul_peak_flops(n=0)
