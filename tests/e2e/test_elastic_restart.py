"""Elastic restart: `zerospeed launch --max-restarts 1` restarts the job after a rank is SIGKILLed and the
documented pattern (`engine.load_checkpoint(dir)` at start, `(None, None)` on a first start) resumes
from `latest`; the final loss equals an uninterrupted run's exactly (fp32, dropout on: RNG restored)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent('''
    import argparse, json, os, signal
    import torch
    import zerospeed
    from zerospeed.testing.models import random_tokens, tiny_gpt
    from zerospeed.testing.parity import global_batches, train_engine

    def job(ckpt, steps=9, save_every=3, kill_at=-1):
        config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
        engine, *_ = zerospeed.initialize(model=tiny_gpt(seed=0, dropout=0.1), config=config)
        path, _ = engine.load_checkpoint(ckpt)  # (None, None) on a first start
        batches = global_batches(random_tokens(4 * steps, 64, seed=1), 4, steps)
        losses = {}
        while engine.global_steps < steps:
            step = engine.global_steps
            losses[step] = train_engine(engine, batches[step:step + 1])[0]
            if engine.global_steps % save_every == 0:
                engine.save_checkpoint(ckpt)
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if engine.global_steps == kill_at and engine.global_rank == 1 and first_attempt:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-run, two steps after the last checkpoint
        engine.destroy()
        return path, losses

    if __name__ == "__main__":
        p = argparse.ArgumentParser()
        p.add_argument("--ckpt"); p.add_argument("--out"); p.add_argument("--kill-at", type=int, default=-1)
        a = p.parse_args()
        torch.set_num_threads(1)
        path, losses = job(a.ckpt, kill_at=a.kill_at)
        # the uninterrupted reference, from scratch in the same processes (tiny_gpt re-seeds the RNG)
        _, reference = job(a.ckpt + "-reference")
        if int(os.environ["RANK"]) == 0:
            with open(a.out, "a") as f:
                f.write(json.dumps({"resumed_from": path, "losses": losses, "reference": reference}) + "\\n")
''')


def test_killed_rank_restarts_and_resumes_to_the_same_final_loss(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "elastic.jsonl"
    cmd = [sys.executable, "-m", "zerospeed.cli", "launch", "--nproc-per-node", "2", "--max-restarts", "1",
           str(script), "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--kill-at", "5"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(runs) == 1 and runs[0]["resumed_from"].endswith("global_step3")  # only the restarted group finished
    resumed = {int(k): v for k, v in runs[0]["losses"].items()}
    reference = {int(k): v for k, v in runs[0]["reference"].items()}
    assert sorted(resumed) == list(range(3, 9)) and sorted(reference) == list(range(9))
    assert all(resumed[s] == reference[s] for s in resumed)  # bitwise, the final loss included
