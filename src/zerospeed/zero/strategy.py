"""The interface between the engine and a ZeRO stage, and stage 0 (plain data parallelism).

The engine only orders calls; a strategy owns gradient storage, reduction, the norm and the
optimizer update for its stage. Per optimizer step the engine calls, in order:

    arm()            at the accumulation boundary, before backward: reduce while backward runs
    finish()         after backward: wait for (and average) every reduction
    clip_and_norm()  global gradient norm over all ranks' partitions; clip if max_norm > 0
    optimizer_step() update (each rank its own partition for stages >= 1, then all-gather)
    zero_grad()      clear gradients for the next step
    disarm()         back to accumulating locally
"""
from __future__ import annotations

import abc

import torch
import torch.distributed as dist

from ..comm.logger import CommsLogger
from ..optim.clipping import clip_and_norm
from .data_parallel import GradientAllReducer, ReducePhase


class ZeroStrategy(abc.ABC):
    """One ZeRO stage: how gradients are reduced and where parameters and optimizer states live."""

    stage: int
    optimizer: torch.optim.Optimizer | None  # over what this rank updates (its partition for stages >= 1)
    # reduce at every micro-step's backward, not only at the accumulation boundary (stage 2: gradients
    # are partitioned as they are produced, so they cannot accumulate locally)
    reduce_every_micro_step: bool = False

    @property
    @abc.abstractmethod
    def phase(self) -> ReducePhase: ...

    @abc.abstractmethod
    def arm(self) -> None: ...

    @abc.abstractmethod
    def finish(self) -> None: ...

    @abc.abstractmethod
    def disarm(self) -> None: ...

    @abc.abstractmethod
    def clip_and_norm(self, max_norm: float) -> float: ...

    @abc.abstractmethod
    def optimizer_step(self) -> None: ...

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def remove(self) -> None: ...

    @abc.abstractmethod
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds: {"params", "grads", "optimizer_states", "master_weights"}."""


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


class DataParallelStrategy(ZeroStrategy):
    """Stage 0: every rank holds everything; gradients are all-reduced in buckets during backward.

    params: trainable parameters. optimizer: over the full parameters (may be None for inference).
    group: the data-parallel process group. bucket_size: elements (`reduce_bucket_size`).
    """

    stage = 0

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None, *,
                 group: dist.ProcessGroup | None, bucket_size: int, average: bool = True,
                 predivide_factor: float = 1.0, logger: CommsLogger | None = None):
        self.params = params
        self.optimizer = optimizer
        self.reducer = None
        if params and dist.get_world_size(group) > 1:
            self.reducer = GradientAllReducer(params, group=group, bucket_size=bucket_size, average=average,
                                              predivide_factor=predivide_factor, logger=logger)
        self._phase = ReducePhase.IDLE

    @property
    def phase(self) -> ReducePhase:
        return self.reducer.phase if self.reducer is not None else self._phase

    def arm(self) -> None:
        if self.reducer is not None:
            self.reducer.arm()
        else:
            self._phase = ReducePhase.ARMED

    def finish(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()
        else:
            self._phase = ReducePhase.FINISHED

    def disarm(self) -> None:
        if self.reducer is not None:
            self.reducer.disarm()
        self._phase = ReducePhase.IDLE

    def clip_and_norm(self, max_norm: float) -> float:
        return clip_and_norm(self.params, max_norm)

    def optimizer_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def zero_grad(self) -> None:
        if self.reducer is not None:
            self.reducer.zero_grad()
        else:
            for p in self.params:
                p.grad = None

    def remove(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None

    def memory_breakdown(self) -> dict[str, int]:
        nbytes = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(b.numel() * b.element_size() for b in self.reducer.buffers) if self.reducer else \
            sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        return {"params": nbytes, "grads": grads, "optimizer_states": _optimizer_state_bytes(self.optimizer),
                "master_weights": 0}
