"""The training engine: orders forward, backward, reduction and the optimizer step.

It owns no algorithm: gradient reduction lives in the ZeRO strategy (`zero/`), the update in the
torch optimizer, the LR in the scheduler. What it adds is DeepSpeed's contract
(`DeepSpeedEngine`): `backward` divides the loss by the gradient accumulation steps, `step`
acts only at the accumulation boundary, counters and accessors have DeepSpeed's names.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from ..comm.logger import CommsLogger
from ..zero.data_parallel import ReducePhase
from ..zero.strategy import ZeroStrategy
from .telemetry import Telemetry

log = logging.getLogger(__name__)


class ZeroSpeedEngine(nn.Module):
    """Wraps `module` for data-parallel training; built by `zerospeed.initialize`.

    Use: `loss = engine(batch)`, `engine.backward(loss)`, `engine.step()` every micro-batch.
    Attributes: module, optimizer, lr_scheduler, global_steps (optimizer steps taken),
    global_samples (samples consumed by those steps, all ranks), micro_steps, device,
    dp_world_size, global_rank, local_rank.
    """

    def __init__(self, *, module: nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler,
                 strategy: ZeroStrategy, group: dist.ProcessGroup | None, device: torch.device,
                 train_batch_size: int, micro_batch_size: int, gradient_accumulation_steps: int,
                 gradient_clipping: float, zero_stage: int, steps_per_print: int,
                 comms_logger: CommsLogger | None, telemetry: Telemetry, training_dataloader=None,
                 local_rank: int = 0):
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.strategy = strategy
        self.group = group
        self.device = device
        self.comms_logger = comms_logger
        self.telemetry = telemetry
        self.training_dataloader = training_dataloader
        self._train_batch_size = train_batch_size
        self._micro_batch_size = micro_batch_size
        self._gas = gradient_accumulation_steps
        self._clip = gradient_clipping
        self._zero_stage = zero_stage
        self._steps_per_print = steps_per_print
        self.global_rank = dist.get_rank()
        self.local_rank = local_rank
        self.dp_world_size = dist.get_world_size(group)
        self.world_size = dist.get_world_size()
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self._in_no_sync = False
        self._step_applied = False
        self._last_print = time.perf_counter()

    # -- forward / backward / step ----------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.telemetry.forward_begin(args, self.global_steps)
        try:
            return self.module(*args, **kwargs)
        finally:
            self.telemetry.forward_end(self.global_steps)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the last micro-batch of a step: `(micro_steps + 1) % gradient_accumulation_steps == 0`."""
        return (self.micro_steps + 1) % self._gas == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Back-propagate `loss` / gradient_accumulation_steps; at the boundary, all-reduce gradients
        in buckets while backward runs. Returns the scaled loss. Raises ValueError for a non-scalar
        loss without a gradient."""
        self.telemetry.record_loss(loss)
        if scale_wrt_gas and self._gas > 1:
            loss = loss / self._gas
        reduce = (self.is_gradient_accumulation_boundary() or self.strategy.reduce_every_micro_step) and not self._in_no_sync
        if reduce:
            self.strategy.arm()
        timers = self.telemetry.timers
        timers.start("bwd_inner")
        try:
            loss.backward(retain_graph=retain_graph)
        except BaseException:
            if reduce:
                self.strategy.disarm()
            raise
        finally:
            timers.stop("bwd_inner")
        if reduce:
            timers.start("bwd_allreduce")
            self.strategy.finish()
            timers.stop("bwd_allreduce")
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count a micro-batch; at the boundary clip, step the optimizer and the LR scheduler, zero grads.

        Raises RuntimeError inside `no_sync()` (DeepSpeed does the same).
        """
        if self._in_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): leave the context before stepping, "
                               "so the accumulated gradients are reduced first")
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self.telemetry.timers.start("step")
            if self.strategy.phase is not ReducePhase.FINISHED:
                # gradients came from a plain loss.backward(): reduce them now, all at once
                self.strategy.arm()
                self.strategy.finish()
            self._global_grad_norm = self.strategy.clip_and_norm(self._clip)
            if self.optimizer is not None:
                self.strategy.optimizer_step()
                self._step_applied = True
            self.zero_grad()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.global_steps += 1
            self.global_samples += self._train_batch_size
            self.strategy.disarm()
            self.telemetry.timers.stop("step")
            self.telemetry.end_step(self)
            self._maybe_print()
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """Clear the gradients (stage 0 keeps them as views into the buckets and zeroes them in place)."""
        self.strategy.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient reduction inside the context (accumulate locally); not re-entrant."""
        if self._zero_stage >= 2:
            raise RuntimeError(f"no_sync() is incompatible with ZeRO stage {self._zero_stage}: gradients "
                               "are partitioned as they are produced; use gradient_accumulation_steps instead")
        if self._in_no_sync:
            raise RuntimeError("no_sync() is not re-entrant")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # -- accessors (DeepSpeed names) -------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def zero_optimization_stage(self) -> int:
        return self._zero_stage

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self) -> list:
        if not self.optimizer:
            return []
        return [g.get("betas", (g.get("momentum"),))[0] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient 2-norm before clipping, from the last optimizer step."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def fp16_enabled(self) -> bool:
        return False

    def bfloat16_enabled(self) -> bool:
        return False

    def destroy(self) -> None:
        """Remove hooks and release gradient buckets; the process group is left to the caller."""
        self.strategy.remove()
        self.telemetry.close()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of model states this rank holds: params, grads, optimizer_states, master_weights."""
        return self.strategy.memory_breakdown()

    def _maybe_print(self) -> None:
        if self._steps_per_print and self.global_steps % self._steps_per_print == 0 and self.global_rank == 0:
            now = time.perf_counter()
            rate = self._steps_per_print * self._train_batch_size / max(now - self._last_print, 1e-9)
            self._last_print = now
            log.info("step=%d, skipped=%d, lr=%s, grad_norm=%.4g, samples/s=%.1f", self.global_steps,
                     self.skipped_steps, self.get_lr(), self._global_grad_norm or 0.0, rate)
