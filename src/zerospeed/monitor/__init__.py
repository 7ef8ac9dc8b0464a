"""Monitors for the `tensorboard`, `wandb` and `csv_monitor` config blocks (DeepSpeed's keys).

    master = MonitorMaster(rank=rank, csv_monitor={"enabled": True, "output_path": "logs"})
    master.write_events([("Train/Samples/lr", 3e-4, 128)])
"""
from .monitors import (DEFAULT_JOB_NAME, CSVMonitor, Event, MissingMonitorPackageError, Monitor, MonitorMaster,
                       TensorBoardMonitor, WandbMonitor)

__all__ = ["Monitor", "MonitorMaster", "CSVMonitor", "TensorBoardMonitor", "WandbMonitor",
           "MissingMonitorPackageError", "Event", "DEFAULT_JOB_NAME"]
