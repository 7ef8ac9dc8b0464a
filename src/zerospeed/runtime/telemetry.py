"""What the engine reports about itself: wall-clock breakdown, monitors and the flops profiler.

The engine calls the `Telemetry` hooks at fixed points of a micro-step; everything is cheap when
the corresponding config block is off (a timer read is a `perf_counter()` call; accelerator
synchronisation happens only with `wall_clock_breakdown: true`).

Timers (seconds, summed over the micro-steps of one optimizer step):
    fwd            engine.forward
    bwd_inner      loss.backward() (compute; bucket reductions start inside it and overlap)
    bwd_allreduce  waiting for the reductions after backward (communication not hidden)
    step           clipping, optimizer, scheduler at the boundary
    other          the rest of the step's wall time: data loading and user code between calls
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch

from ..profiling.peak import sync

log = logging.getLogger(__name__)

TIMERS = ("fwd", "bwd_inner", "bwd_allreduce", "step")


class StepTimers:
    """Named wall-clock timers, accumulated per optimizer step and averaged per print window."""

    def __init__(self, device: torch.device, synchronize: bool):
        self.device = device
        self.synchronize = synchronize
        self.current: dict[str, float] = defaultdict(float)
        self.window: dict[str, float] = defaultdict(float)
        self.window_steps = 0
        self._started: dict[str, float] = {}
        self._step_start = time.perf_counter()

    def start(self, name: str) -> None:
        if self.synchronize:
            sync(self.device)
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.synchronize:
            sync(self.device)
        self.current[name] += time.perf_counter() - self._started.pop(name)

    def end_step(self) -> dict[str, float]:
        """Close the optimizer step: returns this step's seconds per timer (with `other`, `total`)."""
        now = time.perf_counter()
        step = {name: self.current.get(name, 0.0) for name in TIMERS}
        step["total"] = now - self._step_start
        step["other"] = max(step["total"] - sum(step[n] for n in TIMERS), 0.0)
        for k, v in step.items():
            self.window[k] += v
        self.window_steps += 1
        self.current.clear()
        self._step_start = now
        return step

    def window_report(self) -> str:
        """'time (ms) | fwd: ... | bwd_inner: ... | ...', averaged per step over the window; resets it."""
        n = max(self.window_steps, 1)
        parts = [f"{k}: {self.window[k] * 1e3 / n:.2f}" for k in (*TIMERS, "other", "total")]
        self.window.clear()
        self.window_steps = 0
        return "time (ms) | " + " | ".join(parts)


class Telemetry:
    """Timers, monitor events and the flops profiler for one engine.

    rank: global rank (only rank 0 prints and writes). monitor: a `MonitorMaster` or None.
    profiler: a `FlopsProfiler` or None, with its config block `profiler_cfg`.
    wall_clock_breakdown: print the timer table every `steps_per_print` steps.
    """

    def __init__(self, *, rank: int, device: torch.device, steps_per_print: int, wall_clock_breakdown: bool,
                 monitor=None, profiler=None, profiler_cfg=None):
        self.rank = rank
        self.steps_per_print = steps_per_print
        self.wall_clock_breakdown = wall_clock_breakdown
        self.timers = StepTimers(device, synchronize=wall_clock_breakdown)
        self.monitor = monitor if monitor is not None and monitor.enabled else None
        self.profiler = profiler
        self.profiler_cfg = profiler_cfg
        self._loss_sum: torch.Tensor | None = None
        self._micro = 0
        self._tokens = 0
        self.last_step: dict[str, float] = {}

    # -- per micro-step ------------------------------------------------------------------
    def profiling(self, global_steps: int) -> bool:
        return self.profiler is not None and self.rank == 0 and global_steps == self.profiler_cfg.profile_step

    def forward_begin(self, args, global_steps: int) -> None:
        if args and torch.is_tensor(args[0]) and args[0].dim() == 2 and not args[0].is_floating_point():
            self._tokens += args[0].numel()  # [batch, seq] token ids
        if self.profiling(global_steps):
            self.profiler.start_profile()
        self.timers.start("fwd")

    def forward_end(self, global_steps: int) -> None:
        self.timers.stop("fwd")
        if self.profiling(global_steps):
            self.profiler.stop_profile()

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.monitor is None:
            return
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._micro += 1

    # -- per optimizer step ---------------------------------------------------------------
    def end_step(self, engine) -> None:
        step = self.timers.end_step()
        self.last_step = step
        tokens, self._tokens = self._tokens, 0
        if self.profiling(engine.global_steps - 1):
            c = self.profiler_cfg
            self.profiler.print_model_profile(profile_step=c.profile_step, module_depth=c.module_depth,
                                              top_modules=c.top_modules, detailed=c.detailed,
                                              output_file=c.output_file, fwd_latency=step["fwd"],
                                              bwd_latency=step["bwd_inner"] + step["bwd_allreduce"],
                                              step_latency=step["total"])
            self.profiler.end_profile()
        if self.monitor is not None:
            self._write_events(engine, step, tokens)
        if self.rank == 0 and self.wall_clock_breakdown and engine.global_steps % self.steps_per_print == 0:
            log.info("step %d: %s", engine.global_steps, self.timers.window_report())

    def _write_events(self, engine, step: dict[str, float], tokens: int) -> None:
        import psutil  # only when a monitor is enabled

        x = engine.global_samples
        events = [("Train/Samples/lr", engine.get_lr()[0] if engine.get_lr() else 0.0, x),
                  ("Train/Samples/samples_per_sec", engine.train_batch_size() / max(step["total"], 1e-9), x),
                  ("Train/Samples/rss_gib", psutil.Process().memory_info().rss / 2**30, x)]
        if self._loss_sum is not None:  # this rank's mean micro-batch loss (unscaled)
            events.append(("Train/Samples/train_loss", float(self._loss_sum) / max(self._micro, 1), x))
        if engine.get_global_grad_norm() is not None:
            events.append(("Train/Samples/grad_norm", engine.get_global_grad_norm(), x))
        if tokens:
            events.append(("Train/Samples/tokens_per_sec", tokens * engine.dp_world_size / max(step["total"], 1e-9), x))
        if engine.fp16_enabled():  # DeepSpeed writes the loss scale only under fp16
            events.append(("Train/Samples/loss_scale", float(engine.loss_scale), x))
        if self.wall_clock_breakdown:
            events += [(f"Train/Samples/elapsed_time_ms_{k}", v * 1e3, x) for k, v in step.items()]
        self.monitor.write_events(events)
        self._loss_sum, self._micro = None, 0

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
