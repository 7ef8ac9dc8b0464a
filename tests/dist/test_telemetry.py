"""Monitors, wall-clock breakdown and the flops profiler, switched on from the ds_config."""
import csv
from pathlib import Path

import zerospeed
from zerospeed.testing.models import random_tokens, tiny_gpt
from zerospeed.testing.spawn import run_distributed

STEPS = 4


def run(rank, world, out_dir):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "wall_clock_breakdown": True,
           "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "job"},
           "flops_profiler": {"enabled": True, "profile_step": 1, "top_modules": 1,
                              "output_file": f"{out_dir}/profile.txt"}}
    engine, _, _, _ = zerospeed.initialize(model=tiny_gpt(), config=cfg)
    data = random_tokens(2, 64, seed=rank)
    for _ in range(STEPS * 2):
        engine.backward(engine(data[:, :-1], data[:, 1:]))
        engine.step()
    timers = dict(engine.telemetry.last_step)
    engine.destroy()
    return timers


def test_csv_monitor_timers_and_flops_profile(tmp_path):
    timers = run_distributed(run, 2, str(tmp_path))[0]
    # wall-clock breakdown: every timer measured, and they add up to the step's wall time
    assert all(timers[k] > 0 for k in ("fwd", "bwd_inner", "step", "total"))
    parts = timers["fwd"] + timers["bwd_inner"] + timers["bwd_allreduce"] + timers["step"] + timers["other"]
    assert abs(parts - timers["total"]) < 1e-6
    # csv monitor: one file per event, header + one row per optimizer step, x = samples (8 per step)
    job = tmp_path / "job"
    names = {p.stem for p in job.glob("*.csv")}
    for name in ("Train_Samples_lr", "Train_Samples_train_loss", "Train_Samples_grad_norm",
                 "Train_Samples_tokens_per_sec", "Train_Samples_elapsed_time_ms_fwd"):
        assert name in names, sorted(names)
    rows = list(csv.reader(open(job / "Train_Samples_train_loss.csv")))
    assert rows[0][0] == "step" and len(rows) == 1 + STEPS
    assert [int(r[0]) for r in rows[1:]] == [8, 16, 24, 32]
    tok = list(csv.reader(open(job / "Train_Samples_tokens_per_sec.csv")))
    assert float(tok[1][1]) > 0
    # flops profiler at step 1: the table names every top-level block
    text = Path(tmp_path / "profile.txt").read_text()
    assert "blocks.0" in text and "blocks.1" in text and "fwd flops per device" in text
