"""Monitors: CSV layout (one file per event, one row per write), rank 0 only, optional packages."""
import csv
import sys
import types

import pytest
import torch

from zerospeed.monitor import (CSVMonitor, MissingMonitorPackageError, MonitorMaster, TensorBoardMonitor,
                               WandbMonitor)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def events_for(step):
    return [("Train/Samples/lr", 1e-3 / step, step), ("Train/Samples/train_loss", torch.tensor(5.0 - step), step)]


def test_csv_one_file_per_event_one_row_per_step(tmp_path):
    mon = CSVMonitor(enabled=True, output_path=str(tmp_path), job_name="run1")
    for step in (8, 16, 24):
        mon.write_events(events_for(step))
    job = tmp_path / "run1"
    assert sorted(p.name for p in job.iterdir()) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    lr = read_csv(job / "Train_Samples_lr.csv")
    assert lr[0] == ["step", "lr"]
    assert [int(r[0]) for r in lr[1:]] == [8, 16, 24]
    assert [float(r[1]) for r in lr[1:]] == pytest.approx([1e-3 / 8, 1e-3 / 16, 1e-3 / 24])
    loss = read_csv(job / "Train_Samples_train_loss.csv")
    assert loss == [["step", "train_loss"], ["8", "-3.0"], ["16", "-11.0"], ["24", "-19.0"]]
    # a resumed job appends to the same files without a second header
    CSVMonitor(enabled=True, output_path=str(tmp_path), job_name="run1").write_events(events_for(32))
    loss = read_csv(job / "Train_Samples_train_loss.csv")
    assert len(loss) == 5 and loss[-1] == ["32", "-27.0"] and sum(r[0] == "step" for r in loss) == 1


def test_csv_rank_and_enabled_gate(tmp_path):
    CSVMonitor(enabled=True, output_path=str(tmp_path), job_name="r1", rank=1).write_events(events_for(1))
    CSVMonitor(enabled=False, output_path=str(tmp_path), job_name="off").write_events(events_for(1))
    assert list(tmp_path.iterdir()) == []


def test_monitor_master_dispatch_and_keys(tmp_path):
    master = MonitorMaster(rank=0, csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
                           tensorboard={"enabled": False}, wandb=None)
    assert master.enabled and list(master.monitors) == ["csv_monitor"]
    master.write_events(events_for(4))
    master.update_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}})
    assert read_csv(tmp_path / "j" / "Train_Samples_lr.csv") == [["step", "lr"], ["4", "0.00025"]]
    assert read_csv(tmp_path / "j" / "config.csv")[1:] == [["train_batch_size", "8"],
                                                        ["zero_optimization", '{"stage": 2}']]
    # a config object with attributes (e.g. a parsed pydantic block) works too; rank 1 writes nothing
    block = types.SimpleNamespace(enabled=True, output_path=str(tmp_path), job_name="k")
    other = MonitorMaster(rank=1, csv_monitor=block)
    other.write_events(events_for(4))
    assert not (tmp_path / "k").exists()
    assert not MonitorMaster().enabled
    with pytest.raises(ValueError, match="'output_path'"):
        MonitorMaster(csv_monitor={"enabled": True, "output_dir": "x"})


def test_missing_packages_name_the_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail even if installed
    with pytest.raises(MissingMonitorPackageError, match="pip install wandb") as err:
        WandbMonitor(enabled=True)
    assert isinstance(err.value, ImportError)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(MissingMonitorPackageError, match="pip install tensorboard"):
        MonitorMaster(rank=1, tensorboard={"enabled": True})  # every rank checks, so all fail together
    WandbMonitor(enabled=False)  # disabled blocks need no package
    TensorBoardMonitor(enabled=False)


def test_wandb_calls_with_a_stand_in_module(monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or types.SimpleNamespace(finish=lambda: calls.append("end"))
    fake.log = lambda data, step=None: calls.append(("log", data, step))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    mon = WandbMonitor(enabled=True, project="p", team="t", group="g")
    mon.write_events(events_for(2))
    mon.close()
    assert calls == [("init", {"project": "p", "group": "g", "entity": "t"}),
                     ("log", {"Train/Samples/lr": 0.0005}, 2), ("log", {"Train/Samples/train_loss": 3.0}, 2), "end"]
    calls.clear()
    WandbMonitor(enabled=True, rank=3).write_events(events_for(2))
    assert calls == []


def test_tensorboard_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mon = TensorBoardMonitor(enabled=True, output_path=str(tmp_path), job_name="tb")
    for step in (1, 2, 3):
        mon.write_events(events_for(step))
    mon.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("Train/Samples/train_loss")] == [(1, 4.0), (2, 3.0),
                                                                                              (3, 2.0)]
