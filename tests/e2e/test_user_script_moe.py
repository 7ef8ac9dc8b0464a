"""DeepSpeedExamples' MoE tutorial script (`training/cifar/cifar10_deepspeed.py --moe`), written as its users write
it (`tests/e2e/scripts/cifar_moe_train.py`: the same calls and config; only the imports name zerospeed), launched
with torchrun on 2 gloo ranks. Two MoE layers (2 and 4 experts, top-2, capacity factor 1.0, so tokens are
dropped) with the script's expert parameter groups, Adam, WarmupLR and clipping at 1.0.

Expert parallelism must not change the numbers: at ep 2 (each rank 1 and 2 of the experts, tokens exchanged by
all-to-all) under ZeRO 2, every rank's per-step losses equal those of the same script at ep 1 (every rank all
the experts) under ZeRO 0, to 1e-6 relative; each rank then holds the experts' share it should (parameter count
= the dense part + its experts). The gating is per rank in both (DeepSpeed's), so the routes are the same.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "cifar_moe_train.py"
TOL = 1e-6
EXPERT = 84 * 84 + 84  # the script's expert: Linear(84, 84)


def _launch(tmp_path, name: str, *args: str) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--moe", "--moe-param-group", "--num-experts", "2", "4", "--top-k", "2", *args, "--out", str(out)]
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "Finished Training" in res.stdout
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _compare(ep1, ep2):
    for r in range(2):
        a, b = ep2[r]["losses"], ep1[r]["losses"]
        assert len(a) == len(b) == 8  # 128 samples, train_batch_size 16
        assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) < TOL, (r, a, b)
        assert ep1[r]["local_experts"] == [2, 4] and ep2[r]["local_experts"] == [1, 2]
        # the gates and the dense layers are replicated; each rank holds half of each layer's experts
        assert ep1[r]["parameters"] - ep2[r]["parameters"] == 3 * EXPERT


def test_moe_script_expert_parallel_equals_replicated_experts(tmp_path):
    _compare(_launch(tmp_path, "ep1", "--stage", "0", "--ep-world-size", "1"),
             _launch(tmp_path, "ep2", "--stage", "2", "--ep-world-size", "2"))


@pytest.mark.slow
def test_moe_script_residual_jitter_bf16_expert_parallel_equals_replicated(tmp_path):
    common = ("--mlp-type", "residual", "--noisy-gate-policy", "Jitter", "--dtype", "bf16", "--stage", "1")
    _compare(_launch(tmp_path, "ep1", *common, "--ep-world-size", "1"),
             _launch(tmp_path, "ep2", *common, "--ep-world-size", "2"))
