"""`PipelineEngine`: runs a pipeline schedule (`pipe.schedule`, plans as data) on one stage of a
`PipelineModule`, with ZeRO over the data-parallel group (DeepSpeed's `PipelineEngine.train_batch`).

One call of `train_batch(data_iter)` walks this rank's action list of the 1F1B schedule (DeepSpeed's
`TrainSchedule`; Narayanan et al. 2019, PipeDream-Flush): `LoadMicroBatch` pulls `(inputs, labels)` from the
iterator on the first stage (inputs) and the last stage (labels), as DeepSpeed; `Forward` runs the stage's
layers (the last stage also `loss_fn(output, labels)`); activations and their gradients move between
neighbouring stages with point-to-point messages over the mesh's "pipe" group (sends asynchronous, receives
blocking; the activation shape and dtype are exchanged once and cached); `Backward` back-propagates the
loss / micro_batches (last stage) or the received output gradient; the data-parallel reduction is armed for
the last micro-batch's backward, so gradients accumulate locally before it (the engine's accumulation
contract); `OptimizerStep` unscales, takes the global norm over every stage (each stage's parameters are
disjoint: the squares are summed over the data group, then the pipe group), clips and steps.

This first increment supports a single-tensor activation, ZeRO stages 0-2 (stage 2 reduce-scatters at every
micro-batch's backward, as outside pipelines), fp32 and bf16, the 1F1B
schedule, and no layers tied across stages; everything else raises NotImplementedError naming it.
"""
from __future__ import annotations

import torch

from ..comm.ops import all_reduce, broadcast, recv, start_send
from ..pipe.schedule import (Backward, Forward, LoadMicroBatch, OptimizerStep, RecvActivation, RecvGrad,
                             ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad, one_f_one_b)
from .engine import ZeroSpeedEngine

__all__ = ["PipelineEngine"]

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


class PipelineEngine(ZeroSpeedEngine):
    """The engine for a `PipelineModule` (built by `zerospeed.initialize`). Use `train_batch(data_iter)`;
    `forward`, `backward` and `step` raise (as DeepSpeed's PipelineEngine)."""

    def _init_pipeline(self, pipe_group) -> None:
        self.pipe_group = pipe_group
        self.num_stages, self.stage_id = self.module.num_stages, self.module.stage_id
        self.micro_batches = self._gas
        self.data_iterator = None
        self._schedule = one_f_one_b(self.num_stages, self.micro_batches)[self.stage_id]
        self._recv_shape: tuple | None = None  # (shape, dtype) of this stage's input, learned once
        self._sent_shape: tuple | None = None

    # -- DeepSpeed's accessors ------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator) -> None:
        self.data_iterator = iterator

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) instead of "
                           "engine(batch) / engine.backward / engine.step")

    def backward(self, *args, **kwargs):
        self.forward()

    def step(self, *args, **kwargs):
        self.forward()

    # -- point-to-point -----------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, peer: int, works: list) -> None:
        works.append(start_send(t.contiguous(), peer, group=self.pipe_group, logger=self.comms_logger))

    def _recv(self, shape, dtype, peer: int) -> torch.Tensor:
        return recv(torch.empty(shape, dtype=dtype, device=self.device), peer, group=self.pipe_group,
                    logger=self.comms_logger)

    def _send_activation(self, out: torch.Tensor, peer: int, works: list) -> None:
        if not torch.is_tensor(out):
            raise NotImplementedError(f"pipeline stage {self.stage_id} returned {type(out).__name__}: only a single "
                                      "tensor can pass between stages in this version")
        meta = (tuple(out.shape), out.dtype)
        if self._sent_shape is None:  # first micro-batch ever: tell the next stage what to expect
            head = torch.tensor([_DTYPES.index(out.dtype), out.dim(), *out.shape], dtype=torch.int64)
            self._send(torch.tensor([head.numel()], dtype=torch.int64), peer, works)
            self._send(head, peer, works)
            self._sent_shape = meta
        elif meta != self._sent_shape:
            raise RuntimeError(f"pipeline stage {self.stage_id} produced an activation of shape {meta[0]} and dtype "
                               f"{meta[1]}, but earlier micro-batches had {self._sent_shape[0]} / {self._sent_shape[1]}: "
                               "every micro-batch must have the same shape (pad or drop the last batch)")
        self._send(out.detach(), peer, works)

    def _recv_activation(self, peer: int) -> torch.Tensor:
        if self._recv_shape is None:
            n = self._recv((1,), torch.int64, peer)
            head = self._recv((int(n),), torch.int64, peer)
            self._recv_shape = (tuple(int(s) for s in head[2:2 + int(head[1])]), _DTYPES[int(head[0])])
        x = self._recv(*self._recv_shape, peer)
        return x.requires_grad_(x.is_floating_point())

    # -- one batch ----------------------------------------------------------------------------------
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Run one global batch (`micro_batches` micro-batches through every stage) and step. Collective over
        the world. Returns the mean loss over the micro-batches and data-parallel ranks, the same 0-d tensor
        on every rank. Raises ValueError without a data iterator on the first or last stage, RuntimeError
        when it runs dry mid-batch (naming the micro-batch)."""
        it = data_iter if data_iter is not None else self.data_iterator
        if it is None and (self.is_first_stage() or self.is_last_stage()):
            raise ValueError("train_batch() needs a data iterator on the first and last stage: pass "
                             "train_batch(data_iter) or call engine.set_dataiterator(...)")
        self.module.train()
        inputs, outputs, labels, grads, losses, works = {}, {}, {}, {}, [], []
        m = self.micro_batches
        # the batch's micro-batches are read before any message is sent, so a short iterator fails here, on
        # the stages that read it, instead of leaving their neighbours waiting mid-batch
        fetched = []
        if self.is_first_stage() or self.is_last_stage():
            for i in range(m):
                try:
                    fetched.append(next(it))
                except StopIteration:
                    raise RuntimeError(f"the data iterator ran dry at micro-batch {i} of {m} (stage {self.stage_id});"
                                       f" give it at least {m} micro-batches per train_batch") from None
        for a in self._schedule:
            if isinstance(a, LoadMicroBatch):
                batch = fetched[a.microbatch]
                x, y = batch if isinstance(batch, (tuple, list)) and len(batch) == 2 else (batch, None)
                if self.is_first_stage():
                    inputs[a.microbatch] = x.to(self.device)
                if self.is_last_stage():
                    labels[a.microbatch] = None if y is None else y.to(self.device)
            elif isinstance(a, RecvActivation):
                inputs[a.microbatch] = self._recv_activation(a.peer)
            elif isinstance(a, Forward):
                out = self.module(inputs[a.microbatch])
                if self.is_last_stage():
                    loss_fn = self.module.loss_fn
                    out = loss_fn(out, labels.pop(a.microbatch)) if loss_fn is not None else out
                    losses.append(out.detach().float())
                outputs[a.microbatch] = out
            elif isinstance(a, SendActivation):
                self._send_activation(outputs[a.microbatch], a.peer, works)
            elif isinstance(a, RecvGrad):
                out = outputs[a.microbatch]
                grads[a.microbatch] = self._recv(tuple(out.shape), out.dtype, a.peer)
            elif isinstance(a, Backward):
                self._backward(a.microbatch, outputs.pop(a.microbatch), grads.pop(a.microbatch, None), m)
                if self.is_first_stage():
                    inputs.pop(a.microbatch, None)  # nothing to send back: drop the micro-batch now
            elif isinstance(a, SendGrad):
                x = inputs.pop(a.microbatch)
                self._send(x.grad if x.grad is not None else torch.zeros_like(x), a.peer, works)
            elif isinstance(a, ReduceTiedGrads):
                pass  # no layer is tied across stages (refused at initialize)
            elif isinstance(a, ReduceGrads):
                for w in works:
                    w.wait()
                works = []
                if self.strategy.phase.value == "armed":
                    self.strategy.finish()
            elif isinstance(a, OptimizerStep):
                self._optimizer_step()
        return self._batch_loss(losses)

    def _backward(self, mb: int, out: torch.Tensor, grad, m: int) -> None:
        if mb == m - 1 or self.strategy.reduce_every_micro_step:
            self.strategy.arm()  # the last micro-batch's backward reduces (the others accumulate locally)
        if self.is_last_stage():
            self.loss_scaler.scale(out / m).backward()
        else:
            torch.autograd.backward(out, grad_tensors=grad)
        if self.strategy.reduce_every_micro_step and mb != m - 1:
            self.strategy.finish()
            self.strategy.disarm()

    def _optimizer_step(self) -> None:
        self._step_applied = False
        self._take_model_step()
        self.micro_steps += self.micro_batches

    def _batch_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean loss over micro-batches (last stage) and data-parallel ranks, broadcast to every stage."""
        t = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            t = torch.stack(losses).mean()
            all_reduce(t, group=self.group, logger=self.comms_logger)
            t /= self.dp_world_size
        broadcast(t, self.num_stages - 1, group=self.pipe_group, logger=self.comms_logger)
        return t
