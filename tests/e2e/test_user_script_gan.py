"""DeepSpeedExamples' GAN example (`training/gan/gan_deepspeed_train.py`), its training loop with the import lines
changed (`tests/e2e/scripts/gan_train.py`; small MLPs and random data in place of DCGAN and torchvision), launched
with `zerospeed launch` on 2 gloo ranks with the example's config (`train_batch_size` 64 scaled to the test, its
Adam block beside the client optimizers). Two engines in one process, the modules called directly, two backward
calls per step, the generator's loss backpropagated through the discriminator: every rank's losses equal plain
PyTorch's (the client Adam, clipping at the default 1.0), bit for bit as measured, asserted to 1e-6 relative.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).parent / "scripts" / "gan_train.py"
CONFIG = {"train_batch_size": 16, "optimizer": {"type": "Adam", "params": {"lr": 0.0002, "betas": [0.5, 0.999],
                                                                           "eps": 1e-8}}, "steps_per_print": 10}


def _reference() -> list[list[float]]:
    spec = importlib.util.spec_from_file_location("gan_train", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script.get_argument_parser().parse_args([])
    script.set_seed(args.manualSeed)
    dataloader = torch.utils.data.DataLoader(script.dataset(), batch_size=args.batchSize, shuffle=True)
    netG, netD = script.build(args.nz)
    criterion = torch.nn.BCELoss()
    optD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    losses = []
    for data in dataloader:
        netD.zero_grad()
        real = data[0]
        label = torch.full((real.size(0),), 1.0)
        err_real = criterion(netD(real).view(-1), label)
        err_real.backward()
        fake = netG(torch.randn(real.size(0), args.nz))
        label.fill_(0.0)
        err_fake = criterion(netD(fake.detach()).view(-1), label)
        err_fake.backward()
        torch.nn.utils.clip_grad_norm_(netD.parameters(), 1.0)
        optD.step()
        netG.zero_grad()
        label.fill_(1.0)
        err_g = criterion(netD(fake).view(-1), label)
        err_g.backward()
        torch.nn.utils.clip_grad_norm_(netG.parameters(), 1.0)
        optG.step()
        losses.append([err_real.item(), err_fake.item(), err_g.item()])
    return losses


def test_gan_script_two_engines_train_as_plain_pytorch(tmp_path):
    (tmp_path / "gan_deepspeed_config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "zerospeed.cli", "launch", "--nproc-per-node", "2", str(SCRIPT),
           "--deepspeed_config", str(tmp_path / "gan_deepspeed_config.json"), "--out", str(out)]
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    ref = _reference()
    assert len(ref) == 8 and ref[-1] != ref[0]
    for r in range(2):
        got = json.loads((out / f"rank{r}.json").read_text())
        assert len(got) == len(ref)
        rel = max(abs(a - b) / abs(b) for row, want in zip(got, ref) for a, b in zip(row, want))
        assert rel < 1e-6, (r, got[-1], ref[-1])
