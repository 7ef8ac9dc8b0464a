"""`zerospeed.comm.log_summary()` (DeepSpeed's `deepspeed.comm.log_summary`) at world 2 on a ZeRO-0 engine with the
comms logger on: the table rank 0 prints and the dictionary every rank returns hold the engine's own calls (counts
and bytes equal `engine.comms_logger.stats`), DeepSpeed's bandwidth formulas (all-reduce bus = algorithmic x
(n-1)/n), and the straggler breakdown (the world's fastest latency per call <= this rank's); a row only one rank
recorded is named, not all-reduced. Plus the pure helpers against DeepSpeed's definitions."""
import contextlib
import io

import pytest
import torch
from torch import nn

from zerospeed.comm.summary import bandwidths, convert_size, trim_mean
from zerospeed.testing.spawn import run_distributed


def summary_run(rank, world):
    import zerospeed
    from zerospeed.comm import CommsLogger

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    engine, *_ = zerospeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "comms_logger": {"enabled": True},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 0}})
    for _ in range(3):
        loss = engine(torch.randn(4, 64)).square().mean()
        engine.backward(loss)
        engine.step()
    extra = CommsLogger()
    if rank == 0:  # a row only this rank has (as a pipeline stage's sends)
        extra.record("send", 16, 64, 0.001, 2)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = zerospeed.comm.log_summary(show_straggler=True, return_dict=True)
    stats = {op: (s.calls, s.bytes) for op, s in engine.comms_logger.stats.items()}
    totals = engine.comms_logger.summary()  # the logger's own per-op totals table
    zerospeed.comm.reset_log()
    return {"printed": out.getvalue(), "result": result, "stats": stats, "totals": totals,
            "after_reset": zerospeed.comm.log_summary(return_dict=True)["summary"]}


def test_log_summary_tabulates_the_engines_collectives():
    ranks = run_distributed(summary_run, 2, timeout=120)
    for rank, r in enumerate(ranks):
        summary = r["result"]["summary"]
        assert r["result"]["metadata"]["world_size"] == 2 and r["result"]["metadata"]["rank"] == rank
        assert "all_reduce" in summary
        for op, (calls, nbytes) in r["stats"].items():
            rows = summary[op]
            assert sum(row["count"] for row in rows.values()) == calls
            assert sum(size * row["count"] for size, row in rows.items()) == nbytes
        for size, row in summary["all_reduce"].items():
            assert row["busbw_avg_gbps"] == pytest.approx(row["tput_avg_gbps"] / 2, rel=1e-9)  # 2(n-1)/n / 2
            assert row["avg_latency_ms"] <= row["total_latency_ms"] and row["msg_size_str"] == convert_size(size)
        stragglers = r["result"]["straggler_analysis"]
        for size, row in stragglers["all_reduce"].items():
            assert row["total_comm_lat_ms"] <= summary["all_reduce"][size]["total_latency_ms"] + 1e-9
            assert row["total_comm_lat_ms"] + row["total_straggler_ms"] == pytest.approx(
                summary["all_reduce"][size]["total_latency_ms"], rel=1e-9)
        assert "send" not in stragglers
        assert r["after_reset"] == {}
        assert r["totals"].startswith("op") and "\nall_reduce" in r["totals"]
    printed = ranks[0]["printed"]
    assert printed.startswith("Comm. Op") and "busbw_avg (Gbps)" in printed and "\nall_reduce\n" in printed
    assert "Breakdown with straggler effect" in printed
    assert "not on every rank equally often (no straggler figures): send 64.0 B" in printed
    assert ranks[1]["printed"] == ""  # rank 0 prints


def test_bandwidth_formulas_and_helpers_are_deepspeeds():
    gbps = 1e9 / 8  # bytes per second of 1 Gbps
    assert bandwidths("all_reduce", int(gbps), 1.0, 4) == pytest.approx((2.0, 1.5))  # 2S/t, 2(n-1)/n S/t
    assert bandwidths("all_gather", int(gbps), 1.0, 4) == pytest.approx((1.0, 0.75))  # S full: S/t, (n-1)/n S/t
    assert bandwidths("reduce_scatter", int(gbps), 0.5, 2) == pytest.approx((2.0, 1.0))
    assert bandwidths("all_to_all", int(gbps), 1.0, 2) == pytest.approx((1.0, 0.5))
    assert bandwidths("send", int(gbps), 1.0, 2) == pytest.approx((1.0, 1.0))
    assert bandwidths("broadcast", 100, 0.0, 2) == (0.0, 0.0)
    assert trim_mean(list(range(10)) + [1000]) == pytest.approx(5.0)  # round(11 x 0.1) = 1 trimmed at each end
    assert trim_mean([]) == 0.0 and trim_mean([3.0]) == 3.0
    assert (convert_size(0), convert_size(1023), convert_size(1024), convert_size(678.86 * 2 ** 20)) == \
        ("0B", "1023.0 B", "1.0 KB", "678.86 MB")
