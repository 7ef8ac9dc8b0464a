"""A plain `python train.py` (no launcher, no distributed environment) runs as world size 1."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, zerospeed
    from zerospeed.testing.models import random_tokens, tiny_gpt
    engine, opt, _, _ = zerospeed.initialize(model=tiny_gpt(), config={
        "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    data = random_tokens(4, 64, seed=0)
    losses = []
    for _ in range(5):
        loss = engine(data[:, :-1], data[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    print("world", engine.world_size, "steps", engine.global_steps, "first", losses[0], "last", losses[-1])
""")


def test_plain_python_runs_as_world_size_1(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    proc = subprocess.run([sys.executable, str(script)], env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[:4] == ["world", "1", "steps", "5"]
    assert float(words[7]) < float(words[5])  # it learns (same batch 5 times)
