"""The demo, run exactly as a user runs it: `zerospeed demo ...` in a subprocess."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from zerospeed.testing.models import GPT, GPT_SIZES

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_demo_trains_and_saves_weights(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zerospeed.cli", "demo", "--steps", "12", "--eval-interval", "6",
           "--max-bytes", "2000000", "--val-bytes", "100000", "--eval-windows", "8", "--sample-bytes", "20",
           "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks" in proc.stdout and "validation" in proc.stdout and "--- sample ---" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["world_size"] == 2
    # 12 steps already beat a uniform guess over bytes (8 bits/byte) by a wide margin
    assert summary["val_bits_per_byte"] < 6.0
    # the saved weights load into a fresh plain module (tied head restored by the module itself)
    model = GPT(GPT_SIZES["demo"])
    missing, unexpected = model.load_state_dict(load_file(out / "model.safetensors"), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    assert torch.equal(model.lm_head.weight, model.wte.weight)


def test_demo_bad_config_fails_before_launch(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zerospeed.cli", "demo", "--config", str(tmp_path / "nope.json")],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_stops_every_rank_cleanly(tmp_path):
    cmd = [sys.executable, "-m", "zerospeed.cli", "demo", "--steps", "100000", "--max-bytes", "2000000",
           "--val-bytes", "100000", "--no-progress", "--out", str(tmp_path / "run")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # own process group, as a terminal's foreground job
    lines = []
    deadline = time.monotonic() + 180
    for line in proc.stdout:  # wait until training is under way
        lines.append(line)
        if line.startswith("step 10/") or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: SIGINT to the whole foreground group
    rest, _ = proc.communicate(timeout=60)
    text = "".join(lines) + rest
    assert proc.returncode == 130, text[-3000:]
    assert "stopped by SIGINT" in text
    assert "Traceback" not in text
    assert not (tmp_path / "run" / "model.safetensors").exists()
