"""Training monitors with DeepSpeed's config keys: CSV files, TensorBoard and Weights & Biases.

An event is `(name, value, step)`, e.g. ("Train/Samples/lr", 3e-4, 128) where step counts
samples, as DeepSpeed's engine logs them. Monitors write on rank 0 only; the caller passes its
rank (these classes never touch torch.distributed). `tensorboard` and `wandb` are optional
packages: enabling their monitor without the package raises `MissingMonitorPackageError` (an
ImportError) on every rank, so a misconfigured job fails at start-up on all ranks together.
"""
from __future__ import annotations

import csv
import dataclasses
import difflib
import importlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Event = tuple[str, float, int]
DEFAULT_JOB_NAME = "DeepSpeedJobName"


class MissingMonitorPackageError(ImportError):
    """An enabled monitor needs a package that is not installed; the message names the pip command."""


def _require(module: str, pip_name: str, block: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingMonitorPackageError(
            f"the {block!r} monitor is enabled but the {pip_name!r} package is not installed: "
            f"run `pip install {pip_name}` or set {block}.enabled to false") from exc


def _scalar(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


class Monitor:
    """Base class: `write_events(events)` on rank 0 when enabled; flush() and close() are optional."""

    enabled: bool = False

    def write_events(self, events: Sequence[Event]) -> None:
        raise NotImplementedError

    def update_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's configuration (no-op unless overridden)."""

    def flush(self) -> None:
        """Push buffered events to storage (no-op unless overridden)."""

    def close(self) -> None:
        """Release files or sessions (no-op unless overridden)."""


class CSVMonitor(Monitor):
    """One CSV file per event name under `output_path/job_name/` (DeepSpeed's `csv_monitor`).

    The file name is the event name with "/" and " " replaced by "_" (+ ".csv"); its header is
    `step,<last part of the name>` and each event appends one row `step,value`. Files are opened
    in append mode so a resumed job continues them; the header is written only to a new or empty
    file. enabled: write at all. output_path: base directory ("" = the working directory).
    job_name: subdirectory. rank: this process's global rank (only rank 0 writes).
    """

    def __init__(self, *, enabled: bool = False, output_path: str = "", job_name: str = DEFAULT_JOB_NAME,
                 rank: int = 0) -> None:
        self.enabled = bool(enabled) and rank == 0
        self.log_dir = os.path.join(output_path or "", job_name)
        if self.enabled:
            os.makedirs(self.log_dir, exist_ok=True)

    def path_for(self, name: str) -> str:
        """The CSV file that receives events called `name`."""
        return os.path.join(self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv")

    def write_events(self, events: Sequence[Event]) -> None:
        if not self.enabled:
            return
        for name, value, step in events:
            path = self.path_for(name)
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([int(step), _scalar(value)])

    def update_config(self, config: Mapping[str, Any]) -> None:
        """Write `config.csv` (key,value rows) next to the event files."""
        if not self.enabled:
            return
        with open(os.path.join(self.log_dir, "config.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["key", "value"])
            for key, value in config.items():
                writer.writerow([key, json.dumps(value) if isinstance(value, (dict, list)) else value])


class TensorBoardMonitor(Monitor):
    """Scalars to a TensorBoard event file in `output_path/job_name/` (DeepSpeed's `tensorboard`).

    Each event becomes `SummaryWriter.add_scalar(name, value, step)`; events are flushed after
    every write_events call. Raises MissingMonitorPackageError when enabled and the `tensorboard`
    package is missing.
    """

    def __init__(self, *, enabled: bool = False, output_path: str = "", job_name: str = DEFAULT_JOB_NAME,
                 rank: int = 0) -> None:
        self.writer = None
        self.log_dir = os.path.join(output_path or "", job_name)
        tb = _require("torch.utils.tensorboard", "tensorboard", "tensorboard") if enabled else None
        self.enabled = bool(enabled) and rank == 0
        if self.enabled:
            os.makedirs(self.log_dir, exist_ok=True)
            self.writer = tb.SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Sequence[Event]) -> None:
        if not self.enabled:
            return
        for name, value, step in events:
            self.writer.add_scalar(name, _scalar(value), int(step))
        self.writer.flush()

    def update_config(self, config: Mapping[str, Any]) -> None:
        if self.enabled:
            self.writer.add_text("zerospeed/config", json.dumps(dict(config), indent=2, default=str), global_step=0)

    def flush(self) -> None:
        if self.enabled:
            self.writer.flush()

    def close(self) -> None:
        if self.enabled:
            self.writer.close()


class WandbMonitor(Monitor):
    """Scalars to Weights & Biases (DeepSpeed's `wandb` block).

    On rank 0, `wandb.init(project=project, group=group, entity=team)` at construction and
    `wandb.log({name: value}, step=step)` per event. Raises MissingMonitorPackageError when enabled
    and the `wandb` package is missing.
    """

    def __init__(self, *, enabled: bool = False, project: str = "deepspeed", team: str | None = None,
                 group: str | None = None, rank: int = 0) -> None:
        self.project, self.team, self.group = project, team, group
        self._wandb = _require("wandb", "wandb", "wandb") if enabled else None
        self.enabled = bool(enabled) and rank == 0
        self.run = self._wandb.init(project=project, group=group, entity=team) if self.enabled else None

    def write_events(self, events: Sequence[Event]) -> None:
        if not self.enabled:
            return
        for name, value, step in events:
            self._wandb.log({name: _scalar(value)}, step=int(step))

    def update_config(self, config: Mapping[str, Any]) -> None:
        if self.enabled:
            self._wandb.config.update(dict(config), allow_val_change=True)

    def close(self) -> None:
        if self.enabled and self.run is not None:
            self.run.finish()


_BLOCKS: dict[str, type[Monitor]] = {"tensorboard": TensorBoardMonitor, "wandb": WandbMonitor,
                                     "csv_monitor": CSVMonitor}
_KEYS = {"tensorboard": ("enabled", "output_path", "job_name"), "wandb": ("enabled", "project", "team", "group"),
         "csv_monitor": ("enabled", "output_path", "job_name")}


def _block_kwargs(block: str, values: Any) -> dict[str, Any]:
    """Keyword arguments of one monitor block given as a mapping or an object with those fields."""
    if values is None:
        return {}
    if hasattr(values, "model_dump"):
        values = values.model_dump()
    elif dataclasses.is_dataclass(values):
        values = dataclasses.asdict(values)
    elif not isinstance(values, Mapping):
        values = {k: getattr(values, k) for k in _KEYS[block] if hasattr(values, k)}
    for key in values:
        if key not in _KEYS[block]:
            close = difflib.get_close_matches(key, _KEYS[block], n=1, cutoff=0.0)
            raise ValueError(f"unknown {block} key {key!r}; did you mean {close[0]!r}? "
                             f"Valid keys: {', '.join(_KEYS[block])}")
    return dict(values)


class MonitorMaster(Monitor):
    """Fans events out to the enabled monitors (DeepSpeed's `MonitorMaster`).

    tensorboard / wandb / csv_monitor: each block's keys (enabled, output_path, job_name for
    tensorboard and csv_monitor; enabled, project, team, group for wandb) as a mapping or an object
    with those attributes; None = disabled. rank: this process's global rank; only rank 0 builds
    monitors and writes (package checks still run on every rank). `enabled` is true if any block
    is enabled. Raises ValueError for an unknown key (naming the closest valid one) and
    MissingMonitorPackageError for an enabled block whose package is missing.
    """

    def __init__(self, *, rank: int = 0, tensorboard: Any = None, wandb: Any = None,
                 csv_monitor: Any = None) -> None:
        blocks = {"tensorboard": tensorboard, "wandb": wandb, "csv_monitor": csv_monitor}
        self.rank = rank
        self.monitors: dict[str, Monitor] = {}
        self.enabled = False
        for name, values in blocks.items():
            kwargs = _block_kwargs(name, values)
            if kwargs.get("enabled", False):
                self.enabled = True
                self.monitors[name] = _BLOCKS[name](rank=rank, **kwargs)

    def write_events(self, events: Iterable[Event]) -> None:
        if self.rank != 0:
            return
        events = list(events)
        for monitor in self.monitors.values():
            monitor.write_events(events)

    def update_config(self, config: Mapping[str, Any]) -> None:
        for monitor in self.monitors.values():
            monitor.update_config(config)

    def flush(self) -> None:
        for monitor in self.monitors.values():
            monitor.flush()

    def close(self) -> None:
        for monitor in self.monitors.values():
            monitor.close()
