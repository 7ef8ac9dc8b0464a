"""`zerospeed launch` end to end: real torchrun, real gloo ranks, run as a user would from the shell."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import argparse, os, sys
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if rank == args.fail_rank:
        # os._exit: skip interpreter teardown. With sys.exit the live gloo process group's destructor
        # sometimes aborts ("terminate called without an active exception", SIGABRT) before the exit
        # code is reported, which is torch's behaviour, not the launcher's under test.
        os._exit(3)
    with open(os.path.join(args.out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{int(t.item())} {world} {os.environ['LOCAL_RANK']}")
    dist.destroy_process_group()
""")


def _launch_cmd(tmp_path, out_dir, *extra: str) -> list[str]:
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    out_dir.mkdir(exist_ok=True)
    return [sys.executable, "-m", "zerospeed.cli", "launch", "--nproc-per-node", "2", str(script),
            "--out", str(out_dir), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_two_ranks_all_reduce_and_concurrent_launches_do_not_collide(tmp_path):
    # Two launches at once: with no --master-port each uses torchrun --standalone (its own free port).
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen(_launch_cmd(tmp_path, out), env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for out in outs]
    for proc in procs:
        log, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, log
    for out in outs:
        seen = sorted((out / f"rank{r}.txt").read_text() for r in range(2))
        assert seen == ["3 2 0", "3 2 1"]  # sum of rank+1 over 2 ranks; world 2; local ranks 0, 1


def test_failing_rank_gives_nonzero_exit(tmp_path):
    res = subprocess.run(_launch_cmd(tmp_path, tmp_path / "out", "--fail-rank", "1"), env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "exitcode  : 3" in res.stderr and "FAILED" in res.stderr
