"""`zerospeed launch` failure reporting (issue 17): one rank-tagged error, not one traceback per rank.

Real torchrun, real ranks, run as a user would; plus the summary formatter on hand-made torchelastic
failures (no processes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from zerospeed.launcher.launch import _without_final_message, build_torchrun_args, format_failures, parse_args

LIMIT_S = 30


def _launch(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "zerospeed.cli", "launch", "--nproc-per-node", "2", *args]
    start = time.perf_counter()
    res = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=LIMIT_S)
    return res, time.perf_counter() - start


def test_two_failing_ranks_print_one_rank_tagged_error(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        def build_optimizer(lr):
            if lr > 1:
                raise ValueError(f"learning rate {lr} is larger than 1")

        build_optimizer(3.0)
    """))
    res, elapsed = _launch(tmp_path, str(script))
    err = res.stderr
    assert res.returncode == 1, err
    assert elapsed < LIMIT_S
    assert err.count("[rank 0, 1] ValueError: learning rate 3.0 is larger than 1") == 1, err
    assert err.count("learning rate 3.0 is larger than 1") == 1, err  # the message once, tagged
    assert err.count("Traceback (most recent call last)") == 1, err  # the first failing rank's, once
    assert err.count('raise ValueError(f"learning rate {lr} is larger than 1")') == 1, err
    assert f'File "{script}", line 6, in <module>' in err  # the user's frames, absolute path as python
    assert "zerospeed/launcher/record.py" not in err and "runpy" not in err  # wrapper frames trimmed
    assert "zerospeed launch: 2 of 2 ranks failed:" in err
    for noise in ("To enable traceback", "Root Cause", "failed (exitcode", "error_file"):
        assert noise not in err, err
    assert res.stdout == ""


def test_one_failing_rank_in_module_mode_and_the_script_semantics_kept(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(textwrap.dedent("""
        import json, os, sys, time
        out = sys.argv[-1]
        if int(os.environ["RANK"]) == 1:
            # fail only once rank 0 is done: torchrun stops (SIGTERM) the ranks still running at a failure
            deadline = time.monotonic() + 20
            while not os.path.exists(out) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.5)
            {}["optimizer"]
        with open(out + ".tmp", "w") as f:
            json.dump({"name": __name__, "argv": sys.argv[1:], "path0": sys.path[0]}, f)
        os.replace(out + ".tmp", out)
    """))
    res, elapsed = _launch(tmp_path, "-m", "mypkg.train", "--flag", str(tmp_path / "rank0.json"))
    err = res.stderr
    assert res.returncode == 1, err
    assert elapsed < LIMIT_S
    assert err.count("[rank 1] KeyError: 'optimizer'") == 1 and "[rank 0" not in err, err
    assert "zerospeed launch: 1 of 2 ranks failed:" in err and err.count("Traceback") == 1, err
    seen = json.loads((tmp_path / "rank0.json").read_text())  # rank 0 ran as `python -m mypkg.train`
    assert seen == {"name": "__main__", "argv": ["--flag", str(tmp_path / "rank0.json")], "path0": str(tmp_path)}


def test_a_script_runs_as_python_would_run_it(tmp_path):
    sub = tmp_path / "jobs"
    sub.mkdir()
    (sub / "helper.py").write_text("VALUE = 7\n")
    (sub / "job.py").write_text(textwrap.dedent("""
        import json, os, sys
        import helper  # from the script's own directory, as with `python jobs/job.py`
        if __name__ == "__main__":
            out = os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"])
            with open(out, "w") as f:
                json.dump({"argv0": sys.argv[0], "file": __file__, "value": helper.VALUE}, f)
    """))
    res, elapsed = _launch(tmp_path, "jobs/job.py", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert elapsed < LIMIT_S
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"argv0": "jobs/job.py", "file": str(sub / "job.py"), "value": 7}


# ------------------------------------------------------------------ the formatter, without processes


def _failure(tmp_path, rank: int, message: str | None, exitcode: int = 1, timestamp: int = 100) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    if message is not None:
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": f"Traceback (most recent call last):\n  File \"t.py\", line 1\n{message}\n",
            "timestamp": str(timestamp)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_format_groups_ranks_by_error_first_failure_first(tmp_path):
    exc = ChildFailedError("train.py", {
        0: _failure(tmp_path, 0, "RuntimeError: Connection closed by peer", timestamp=101),
        1: _failure(tmp_path, 1, "ValueError: bad lr", timestamp=100),
        2: _failure(tmp_path, 2, "ValueError: bad lr", timestamp=101),
        3: _failure(tmp_path, 3, None, exitcode=-15),
    })
    text = format_failures(exc, world_size=4)
    assert text.splitlines()[0] == "zerospeed launch: rank 1 failed first; its traceback:"
    assert text.count("Traceback") == 1 and text.count("bad lr") == 1  # traceback without its last line
    assert text.splitlines()[-4:] == ["zerospeed launch: 4 of 4 ranks failed:", "[rank 1, 2] ValueError: bad lr",
                                      "[rank 0] RuntimeError: Connection closed by peer",
                                      "[rank 3] stopped by signal SIGTERM"]


@pytest.mark.parametrize("stack_end, message, kept", [
    ("ValueError: bad lr", "ValueError: bad lr", False),
    ("zerospeed.config.errors.ConfigError: invalid ds_config (2 problems):\n  - a\n  - b",
     "ConfigError: invalid ds_config (2 problems):\n  - a\n  - b", False),
    ("ValueError", "ValueError: ", False),                          # raise ValueError()
    ("ValueError: bad lr\n\nsome note", "ValueError: bad lr", True),  # add_note(): keep as is
])
def test_traceback_loses_only_a_final_line_repeating_the_message(stack_end, message, kept):
    stack = f"Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\n    f()\n{stack_end}\n"
    out = _without_final_message(stack, message)
    assert out == (stack.rstrip() if kept else 'Traceback (most recent call last):\n  File "t.py", line 1, in <module>\n    f()')


def test_format_without_any_recorded_exception_defers_to_torchrun(tmp_path):
    exc = ChildFailedError("train.py", {1: _failure(tmp_path, 1, None, exitcode=3)})
    assert format_failures(exc, world_size=2) is None  # main() prints torchrun's own table then


def test_record_wrapper_only_in_launched_commands():
    ns = parse_args(["--nproc-per-node", "2", "-m", "pkg.train", "--lr", "1"])
    assert build_torchrun_args(ns)[-4:] == ["--module", "pkg.train", "--lr", "1"]  # printed commands: unchanged
    assert build_torchrun_args(ns, record=True)[-6:] == ["--module", "zerospeed.launcher.record", "--module",
                                                         "pkg.train", "--lr", "1"]
