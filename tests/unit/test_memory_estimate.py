"""ZeRO model-state memory formulas (`zero/memory.py`) and the `zerospeed estimate` CLI."""
import pytest

from zerospeed.cli import main as cli_main
from zerospeed.zero.estimate_cli import parse_count
from zerospeed.zero.memory import (data_parallel_size, estimate_model_parallel_memory, estimate_model_states_memory,
                                   model_parallel_params)


def test_paper_example_7_5b_on_64_ranks():
    """ZeRO, Rajbhandari et al. 2020, Figure 1: 120 -> 31.4 -> 16.6 -> 1.9 GB per rank."""
    gb = [estimate_model_states_memory(7.5e9, s, 64)["total"] / 1e9 for s in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("n", [1, 2, 4, 64])
def test_mixed_precision_formulas(n):
    psi = 1_000_000 * n  # divisible, so Ψ/N is exact
    total = {s: estimate_model_states_memory(psi, s, n)["total"] for s in range(4)}
    assert total == {0: 16 * psi, 1: 4 * psi + 12 * psi // n, 2: 2 * psi + 14 * psi // n, 3: 16 * psi // n}


def test_fp32_breakdown():
    psi, n = 4000, 4
    assert estimate_model_states_memory(psi, 0, n, "fp32") == {
        "params": 4 * psi, "grads": 4 * psi, "optimizer_states": 8 * psi, "master_weights": 0, "total": 16 * psi}
    s1 = estimate_model_states_memory(psi, 1, n, "fp32")
    assert (s1["params"], s1["grads"], s1["optimizer_states"]) == (4 * psi, 4 * psi, 8 * psi // n)
    s2 = estimate_model_states_memory(psi, 2, n, "fp32")
    assert (s2["params"], s2["grads"], s2["optimizer_states"]) == (4 * psi, 4 * psi // n, 8 * psi // n)
    s3 = estimate_model_states_memory(psi, 3, n, "fp32")
    assert s3["total"] == 16 * psi // n


def test_uneven_split_rounds_up_per_rank():
    assert estimate_model_states_memory(53, 3, 4, "fp32")["params"] == 4 * 14


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_params=1, stage=4, dp_world_size=2), "stage"),
    (dict(num_params=1, stage=1, dp_world_size=0), "dp_world_size"),
    (dict(num_params=-1, stage=1, dp_world_size=2), "num_params"),
    (dict(num_params=1, stage=1, dp_world_size=2, precision="bf16"), "precision"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_model_states_memory(**kwargs)


def test_cli_all_stages(capsys):
    assert cli_main(["estimate", "--params", "7.5e9", "--dp", "64"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [r[-1] for r in rows] == ["120.00", "31.41", "16.64", "1.88"]
    assert "mixed precision" in out and "GB = 1e9 bytes" in out


def test_cli_one_stage_fp32(capsys):
    assert cli_main(["estimate", "--params", "7.5B", "--stage", "3", "--dp", "64", "--precision", "fp32"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [["3", "0.47", "0.47", "0.94", "0.00", "1.88"]]


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["estimate", "--params", "lots", "--dp", "2"])
    assert exc.value.code == 2 and "not a parameter count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["estimate", "--params", "1e9", "--dp", "0"])


@pytest.mark.parametrize("text, value", [("7.5e9", 7.5e9), ("7.5B", 7.5e9), ("350M", 3.5e8), ("12k", 12e3), ("10", 10)])
def test_parse_count(text, value):
    assert parse_count(text) == value


def test_model_parallel_params():
    # Ψ_rank = (Ψ_s / tp + Ψ_r) / pp
    assert model_parallel_params(1000, tp=2) == 500
    assert model_parallel_params(1000, tp=2, replicated_params=200) == 600
    assert model_parallel_params(1000, tp=4, pp=2, replicated_params=200) == (800 / 4 + 200) / 2
    assert model_parallel_params(1000, pp=4) == 250
    with pytest.raises(ValueError, match="replicated_params=2000"):
        model_parallel_params(1000, tp=2, replicated_params=2000)
    with pytest.raises(ValueError, match="tp=0"):
        model_parallel_params(1000, tp=0)


@pytest.mark.parametrize("stage", range(4))
def test_model_parallel_memory_is_zero_over_dp_of_the_rank_share(stage):
    psi, rep, world, tp, pp = 8_000_000, 1_600_000, 32, 2, 2
    local = (psi - rep) // tp + rep  # 4.8M per tensor rank, 2.4M per stage
    got = estimate_model_parallel_memory(psi, stage, world, tp=tp, pp=pp, replicated_params=rep)
    assert got == estimate_model_states_memory(local // pp, stage, world // (tp * pp))
    n = world // (tp * pp)
    expected = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage] * (local // pp)
    assert got["total"] == expected
    # tp = pp = 1 is plain ZeRO over the world
    assert estimate_model_parallel_memory(psi, stage, 8) == estimate_model_states_memory(psi, stage, 8)


def test_world_not_divisible_by_tp_x_pp():
    assert data_parallel_size(64, 4, 2) == 8
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tensor x pipeline parallel size 2 x 2 = 4"):
        estimate_model_parallel_memory(1e9, 1, 6, tp=2, pp=2)
    with pytest.raises(ValueError, match="pp must be >= 1"):
        data_parallel_size(4, 1, 0)


def test_cli_tp_pp(capsys):
    argv = ["estimate", "--params", "7B", "--world", "64", "--tp", "4", "--pp", "2", "--replicated-params", "0.26B"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    local = ((7e9 - 0.26e9) / 4 + 0.26e9) / 2
    est = [estimate_model_parallel_memory(7e9, s, 64, tp=4, pp=2, replicated_params=0.26e9) for s in range(4)]
    assert [r[-1] for r in rows] == [f"{m['total'] / 1e9:.2f}" for m in est]
    assert rows[0][-1] == f"{16 * local / 1e9:.2f}"
    assert "N = 8 data-parallel ranks" in out and "world = 4 x 2 x 8 = 64" in out and "balanced pipeline stages" in out
    # --dp with --tp: the world is dp x tp x pp; without --replicated-params the assumption is stated
    assert cli_main(["estimate", "--params", "1e9", "--dp", "2", "--tp", "2", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "Ψ_r = 0: every parameter in a tensor-parallel layer" in out and "--replicated-params" in out
    assert [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()] == [
        ["3", "0.50", "0.50", "2.00", "1.00", "4.00"]]  # 16 bytes x 0.5e9 per tensor rank / 2 ranks


@pytest.mark.parametrize("argv, message", [
    (["--world", "6", "--tp", "4"], "not divisible by tensor x pipeline parallel size 4 x 1 = 4"),
    (["--world", "8", "--tp", "2", "--dp", "2"], "give one of --dp and --world (here --dp 4)"),
    (["--tp", "0"], "--tp must be >= 1"),
    (["--tp", "2", "--replicated-params", "2e9"], "--replicated-params 2e+09 must lie in"),
])
def test_cli_tp_pp_rejects(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli_main(["estimate", "--params", "1e9", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_offload_nvme_largest_model(capsys):
    """ZeRO-Infinity: with a flat host budget the disk sets the largest model: 77 GB / 16 B (bf16: 12 B
    optimizer + 2 B gradient + 2 B parameter per element) = 4.81B; fp32 (20 B) 3.85B; a 4.09B model fits
    in bf16, not in fp32."""
    base = ["estimate", "--offload", "nvme", "--hidden", "2560", "--dp", "2", "--ram", "24e9", "--disk", "77e9"]
    assert cli_main(base + ["--precision", "mixed"]) == 0
    out = capsys.readouterr().out
    assert "largest trainable: Ψ = 4.81B parameters, limited by disk" in out, out
    assert "param_pool 0.39" in out  # 5 buffers x 39.3M elements x 2 bytes
    assert cli_main(base + ["--precision", "fp32"]) == 0
    assert "Ψ = 3.85B parameters, limited by disk" in capsys.readouterr().out
    assert cli_main(base + ["--precision", "mixed", "--params", "4.09B"]) == 0
    assert "Ψ = 4.09e+09: fits" in capsys.readouterr().out
    assert cli_main(base + ["--precision", "fp32", "--params", "4.09B"]) == 0
    assert "Ψ = 4.09e+09: does not fit" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["estimate", "--offload", "nvme", "--dp", "2"])
    assert "needs --hidden" in capsys.readouterr().err
