"""DeepSpeedExamples' pipeline training script (`training/pipeline_parallelism/train.py`), written as its users
write it (`tests/e2e/scripts/pipeline_train.py`: the same calls; only the imports name zerospeed), launched with
`zerospeed launch` (torchrun) as the example's run.sh launches it, on real gloo ranks. Its per-step losses must
equal plain PyTorch's on the same network, data and order:

- `-p 2` (a `PipelineModule` of plain layers and a lambda, `initialize(training_data=...)`, `train_batch()` with
  no iterator): the engine reads the dataset in order, each data-parallel rank its `DistributedSampler` share, over
  and over (DeepSpeed's `RepeatingLoader`); so step s trains on the global batch of samples [s*B, (s+1)*B) mod N.
- `-p 0` (the data-parallel engine, `RepeatingLoader` over the returned loader): each rank's micro-batches follow
  the loader's shuffled order (`DistributedSampler`, seed 0, epoch 0 on every pass).
SGD without clipping, so a wrong gradient scale shows. The runs go past the end of the dataset (the loaders wrap).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "pipeline_train.py"
MICRO, GAS, LR, SEED = 4, 4, 0.05, 1138
TOL = 1e-5  # relative; the ranks' and the reference's float sums run in different orders
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
          "optimizer": {"type": "SGD", "params": {"lr": LR}}, "steps_per_print": 1000}


def _script():
    spec = importlib.util.spec_from_file_location("pipeline_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _launch(tmp_path, world: int, pp: int, steps: int) -> list[list[float]]:
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(CONFIG))
    out = tmp_path / "out"
    out.mkdir()
    # as the example's run.sh (`deepspeed train.py --deepspeed_config=ds_config.json -p 2 --steps=200`)
    cmd = [sys.executable, "-m", "zerospeed.cli", "launch", "--nproc-per-node", str(world), str(SCRIPT),
           f"--deepspeed_config={cfg}", "-p", str(pp), f"--steps={steps}", "--out", str(out)]
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _sgd(net, loss):
    net.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= LR * p.grad


def _pipe_reference(steps: int, dp: int) -> list[float]:
    mod = _script()
    torch.manual_seed(SEED)
    net = mod.AlexNet(num_classes=10)
    x, y = mod.cifar_trainset().tensors
    batch, n = MICRO * GAS * dp, len(x)
    losses = []
    for s in range(steps):
        idx = torch.arange(s * batch, (s + 1) * batch) % n
        loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])  # = the mean of the equal micro-batches'
        losses.append(loss.item())
        _sgd(net, loss)
    return losses


def _base_reference(steps: int, world: int) -> list[list[float]]:
    mod = _script()
    torch.manual_seed(SEED)
    net = mod.AlexNet(num_classes=10)
    x, y = mod.cifar_trainset().tensors
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # DistributedSampler, seed 0, epoch 0
    shares = [perm[r::world] for r in range(world)]
    per_pass = len(shares[0]) // MICRO
    losses = [[] for _ in range(world)]
    for s in range(steps):
        total = 0.0
        for j in range(GAS):
            k = (s * GAS + j) % per_pass
            for r in range(world):
                idx = shares[r][k * MICRO:(k + 1) * MICRO]
                loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
                losses[r].append(loss.item())
                total = total + loss / (GAS * world)
        _sgd(net, total)
    return losses


def _rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs()).max())


def test_pipeline_script_world2_pp2_losses_equal_plain_pytorch(tmp_path):
    steps = 6  # 16 samples a step, 64 in the dataset: the loader wraps after step 4
    ranks = _launch(tmp_path, world=2, pp=2, steps=steps)
    ref = _pipe_reference(steps, dp=1)
    assert ranks[0] == ranks[1]  # train_batch returns the same loss on every rank
    assert _rel(ranks[0], ref) < TOL, (ranks[0], ref)


def test_data_parallel_path_of_the_script_losses_equal_plain_pytorch(tmp_path):
    steps = 3  # 32 samples a step over 2 ranks: the loaders wrap after step 2
    ranks = _launch(tmp_path, world=2, pp=0, steps=steps)
    ref = _base_reference(steps, world=2)
    for r in range(2):
        assert _rel(ranks[r], ref[r]) < TOL, (r, ranks[r], ref[r])


@pytest.mark.slow
def test_pipeline_script_world4_pp2_dp2_losses_equal_plain_pytorch(tmp_path):
    steps = 3  # 32 samples a step: wraps after step 2
    ranks = _launch(tmp_path, world=4, pp=2, steps=steps)
    ref = _pipe_reference(steps, dp=2)
    assert all(r == ranks[0] for r in ranks)
    assert _rel(ranks[0], ref) < TOL, (ranks[0], ref)
