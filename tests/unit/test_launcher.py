"""zerospeed.launcher: hostfile parsing (ported from DeepSpeed's test_run.py) and torchrun argument mapping."""
from __future__ import annotations

import pytest

from zerospeed.launcher import launch
from zerospeed.launcher.hostfile import parse_hostfile, parse_hostfile_text
from zerospeed.launcher.launch import build_torchrun_args, node_commands, parse_args, resolve_plan


# ---------------------------------------------------------------- hostfile (DeepSpeed test_hostfile_good/bad)
def test_hostfile_good():
    hostfile = """
    worker-1 slots=2
    worker-2 slots=2

    localhost slots=1
    123.23.12.10 slots=2

    #worker-1 slots=3
    # this is a comment

    """
    r = parse_hostfile_text(hostfile)
    assert r == {"worker-1": 2, "worker-2": 2, "localhost": 1, "123.23.12.10": 2}
    assert list(r) == ["worker-1", "worker-2", "localhost", "123.23.12.10"]  # file order kept


def test_hostfile_trailing_comment_and_tabs():
    assert parse_hostfile_text("node-a\tslots=8   # big box\nnode-b  slots=8\n") == {"node-a": 8, "node-b": 8}


@pytest.mark.parametrize("text, lineno, fragment", [
    ("\nworker-1 slots=2\nworker-2 slots=1\nworker-1 slots=1\n", 4, "listed twice"),    # duplicate host
    ("\nthis is bad slots=1\n", 2, "this is bad slots=1"),                               # incorrect whitespace
    ("\nmissingslots\n", 2, "missingslots"),                                              # no slots
    ("worker-1 slots=2\nthis is bad slots=1\nworker-2 slots=4\nmissingslots\n", 2, "this is bad"),  # mix
    ("worker-1 slots=0\n", 1, "slots=0"),                                                 # non-positive
    ("worker-1 slots=-2\n", 1, "slots=-2"),
    ("worker-1 slots=two\n", 1, "slots=two"),
    ("worker-1 slots=2 extra\n", 1, "extra"),
])
def test_hostfiles_bad(text, lineno, fragment):
    with pytest.raises(ValueError) as err:
        parse_hostfile_text(text, source="hosts.txt")
    msg = str(err.value)
    assert f"hosts.txt:{lineno}:" in msg and fragment in msg


@pytest.mark.parametrize("text", ["", "\n    \n", "# only a comment\n\n"])
def test_hostfile_empty(text):
    with pytest.raises(ValueError, match="hosts.txt: hostfile is empty"):
        parse_hostfile_text(text, source="hosts.txt")


def test_parse_hostfile_reads_file_and_names_it(tmp_path):
    good = tmp_path / "hostfile"
    good.write_text("a slots=4\nb slots=4\n")
    assert parse_hostfile(good) == {"a": 4, "b": 4}
    bad = tmp_path / "bad"
    bad.write_text("a slots=4\na slots=4\n")
    with pytest.raises(ValueError, match=f"{bad}:2: host 'a' is listed twice"):
        parse_hostfile(str(bad))


def test_parse_hostfile_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="hostfile .*nope.* not found"):
        parse_hostfile(tmp_path / "nope")


# ---------------------------------------------------------------- torchrun argument mapping
def _args(cmd: str) -> list[str]:
    return build_torchrun_args(parse_args(cmd.split()))


_REAL_DEFAULT_NPROC = launch.default_nproc_per_node


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch):
    monkeypatch.setattr(launch, "default_nproc_per_node", lambda: 1)


def test_single_node_defaults_to_standalone():
    assert _args("train.py --lr 1e-3 --out x") == [
        "--standalone", "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "0",
        "train.py", "--lr", "1e-3", "--out", "x"]


def test_default_nproc_follows_accelerators(monkeypatch):
    monkeypatch.setattr(launch, "default_nproc_per_node", lambda: 8)
    assert resolve_plan(parse_args(["t.py"])).nproc_per_node == 8


def test_default_nproc_per_node_is_one_on_cpu():
    import torch

    if torch.accelerator.is_available():
        pytest.skip("machine has an accelerator")
    assert _REAL_DEFAULT_NPROC() == 1


def test_explicit_port_uses_static_rendezvous():
    assert _args("--nproc-per-node 2 --master-port 29600 t.py") == [
        "--nnodes", "1", "--nproc-per-node", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
        "--master-port", "29600", "--max-restarts", "0", "t.py"]


def test_multi_node_static():
    assert _args("--nnodes 2 --nproc-per-node 4 --node-rank 1 --master-addr 10.0.0.1 --max-restarts 3 t.py") == [
        "--nnodes", "2", "--nproc-per-node", "4", "--node-rank", "1", "--master-addr", "10.0.0.1",
        "--master-port", "29500", "--max-restarts", "3", "t.py"]


@pytest.mark.parametrize("ds, ours", [
    ("--num_gpus 2 --num_nodes 2 --node_rank 1 --master_addr h0 --master_port 1234",
     "--nproc-per-node 2 --nnodes 2 --node-rank 1 --master-addr h0 --master-port 1234"),
    ("--num_accelerators 3 --max_restarts 1", "--nproc_per_node 3 --max-restarts 1"),
    ("-H hf", "--hostfile hf"),
])
def test_deepspeed_spellings_are_aliases(ds, ours, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").write_text("localhost slots=2\n")
    assert _args(f"{ds} t.py -a") == _args(f"{ours} t.py -a")


def test_module_and_script_args_pass_through():
    args = _args("-m pkg.train --nnodes 7 --module")
    assert args[-5:] == ["--module", "pkg.train", "--nnodes", "7", "--module"]
    assert args[:2] == ["--standalone", "--nnodes"] and args[2] == "1"  # script's --nnodes not ours


def test_c10d_rendezvous():
    assert _args("--nnodes 2 --rdzv-backend c10d --master-addr h0 t.py")[:6] == [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    assert "h0:29500" in _args("--nnodes 2 --rdzv-backend c10d --master-addr h0 t.py")
    assert "h1:7" in _args("--nnodes 2 --rdzv_backend c10d --rdzv-endpoint h1:7 t.py")


def test_hostfile_sets_nnodes_nproc_and_master(tmp_path):
    hf = tmp_path / "hf"
    hf.write_text("# cluster\nnode-a slots=4\nnode-b slots=4\nnode-c slots=4\n")
    plan = resolve_plan(parse_args(["--hostfile", str(hf), "t.py"]))
    assert (plan.nnodes, plan.nproc_per_node, plan.master_addr, plan.standalone) == (3, 4, "node-a", False)
    assert plan.hosts == ("node-a", "node-b", "node-c")
    assert _args(f"--hostfile {hf} --node-rank 2 t.py")[:10] == [
        "--nnodes", "3", "--nproc-per-node", "4", "--node-rank", "2", "--master-addr", "node-a",
        "--master-port", "29500"]
    # DeepSpeed semantics: --num_nodes takes the first N hosts, --num_gpus at most the slots
    plan = resolve_plan(parse_args(["-H", str(hf), "--num_nodes", "2", "--num_gpus", "2", "t.py"]))
    assert (plan.hosts, plan.nproc_per_node) == (("node-a", "node-b"), 2)


def test_single_host_hostfile_runs_locally(tmp_path):
    hf = tmp_path / "hf"
    hf.write_text("localhost slots=2\n")
    assert _args(f"--hostfile {hf} t.py")[:5] == ["--standalone", "--nnodes", "1", "--nproc-per-node", "2"]


def test_node_commands_for_multi_node_hostfile(tmp_path):
    hf = tmp_path / "hf"
    hf.write_text("node-a slots=2\nnode-b slots=2\n")
    text = node_commands(parse_args(["--hostfile", str(hf), "t.py", "--out", "a b"]))
    assert "[node-a]  torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr node-a" in text
    assert "[node-b]  torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 --master-addr node-a" in text
    assert "t.py --out 'a b'" in text
    assert ('srun --nodes=2 --ntasks-per-node=1 --nodelist=node-a,node-b torchrun --rdzv-id "$SLURM_JOB_ID" '
            "--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node-a:29500") in text


def test_main_prints_commands_instead_of_sshing(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.write_text("node-a slots=1\nnode-b slots=1\n")
    assert launch.main(["--hostfile", str(hf), "t.py"]) == 0
    assert "does not ssh" in capsys.readouterr().out


@pytest.mark.parametrize("hostfile, cmd, match", [
    ("a slots=4\nb slots=2\n", "", r"unequal slots \(a slots=4, b slots=2\).*K <= 2"),
    ("a slots=4\nb slots=2\n", "--nproc-per-node 3", r"--nproc-per-node 3 exceeds the slots of b \(slots=2\)"),
    ("a slots=1\n", "--nnodes 2", r"--nnodes 2 but hostfile .* lists only 1 host\(s\): a"),
    ("a slots=1\nb slots=1\n", "--node-rank 2", r"--node-rank 2 is outside \[0, 2\)"),
])
def test_hostfile_errors(tmp_path, hostfile, cmd, match):
    hf = tmp_path / "hf"
    hf.write_text(hostfile)
    with pytest.raises(ValueError, match=match):
        _args(f"--hostfile {hf} {cmd} t.py")


def test_unequal_slots_ok_when_nproc_fits(tmp_path):
    hf = tmp_path / "hf"
    hf.write_text("a slots=4\nb slots=2\n")
    assert resolve_plan(parse_args(["-H", str(hf), "--nproc-per-node", "2", "t.py"])).nproc_per_node == 2


@pytest.mark.parametrize("cmd, match", [
    ("--nproc-per-node 0", "--nproc-per-node must be >= 1"),
    ("--nnodes 0", "--nnodes must be >= 1"),
    ("--master-port 70000", "--master-port must be in 1..65535"),
    ("--max-restarts -1", "--max-restarts must be >= 0"),
    ("--nnodes 2 --node-rank 0", "needs --master-addr"),
    ("--nnodes 2 --master-addr h0", "needs --node-rank"),
])
def test_argument_errors(cmd, match):
    with pytest.raises(ValueError, match=match):
        _args(f"{cmd} t.py")


def test_main_reports_errors_with_exit_code_2(tmp_path, capsys):
    assert launch.main(["--hostfile", str(tmp_path / "missing"), "t.py"]) == 2
    assert "not found" in capsys.readouterr().err
    assert launch.main([str(tmp_path / "no_such_script.py")]) == 2
    assert "training script" in capsys.readouterr().err
    assert launch.main(["--nnodes"]) == 2  # argparse usage error
    assert launch.main(["--help"]) == 0
