"""`PipelineEngine`: runs a pipeline schedule (`pipe.schedule`, plans as data) on one stage of a
`PipelineModule`, with ZeRO over the data-parallel group (DeepSpeed's `PipelineEngine.train_batch`).

One call of `train_batch(data_iter)` walks this rank's action list of the configured schedule
(`"pipeline": {"schedule": ...}`: 1F1B, DeepSpeed's `TrainSchedule`, by default; GPipe; ZB-H1; interleaved
1F1B and ZB-V on a module with several chunks per rank). One executor runs them all, keyed by (micro-batch,
model stage); `eval_batch` runs the forwards of the same schedule:

* `LoadMicroBatch` pulls `(inputs, labels)` from the iterator: inputs on the first model stage, labels on the
  last (DeepSpeed's); all micro-batches of the batch are read before any message, so a short iterator fails
  on the stages that read it instead of leaving their neighbours waiting.
* `Forward` runs the model stage (the last also `loss_fn(output, labels)`, scaled by 1 / micro_batches and the
  loss scale); when that micro-batch's backward there is split (a `BackwardInput`, or `"split_backward"`) it
  runs as segments (`PipelineModule.forward_segments`), else as one piece; the input of a
  model stage whose predecessor is on the same rank is that one's output, detached (no message).
* activations (tensors or tuples) and their gradients move with point-to-point messages over the mesh's "pipe"
  group (`pipe.p2p.ActivationLink`: sends asynchronous, shapes exchanged once); before each computation the
  receives the next one needs are posted (`pipe.p2p.ReceiveAhead`), so their transfer overlaps it.
* `Backward` is the backward of a micro-batch, `BackwardInput` / `BackwardWeight` its two halves
  (`pipe.backward_split`); with `"split_backward"` (by default in fp32 at ZeRO 0-1 without activation
  checkpointing) a `Backward` runs as the two halves back to back, else as autograd's fused backward, also in
  a schedule that splits other backwards (DualPipeV's fused ones: in bf16 B + W cost 7% more than fused);
  without it a `BackwardInput` followed at once by its own `BackwardWeight` (nothing sent or run between:
  `pipe.actions.fuse_adjacent_backwards`) runs as one fused `Backward` too.
* the data-parallel reduction: stage 0/1 arm it for the trailing run of each stage's final weight-gradient
  pass (1F1B: the last micro-batch's backward), so it overlaps that backward and gradients accumulate locally
  before it; stage 2 reduce-scatters at every weight-gradient pass (DeepSpeed refuses ZeRO 2 with pipelines).
  `ReduceGrads` waits for the sends and finishes the reduction.
* `OptimizerStep` is the engine's boundary step: unscale, the global norm over every stage (each stage's
  parameters are disjoint: squares summed over the data group, then the pipe group), clip, step.

Layers tied across stages (`TiedLayerSpec`) start equal and have their gradients summed over the stages
holding them after the data-parallel reduction (`runtime.pipe_ties`).
"""
from __future__ import annotations

import torch

from ..comm.ops import all_reduce, broadcast
from ..pipe.backward_split import backward_fused, backward_input, backward_weight, detach_input
from ..pipe.p2p import ActivationLink, ReceiveAhead, as_tuple
from ..pipe.schedule import (COMPUTE, Backward, BackwardInput, BackwardWeight, Forward, LoadMicroBatch, OptimizerStep,
                             RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad,
                             build_schedule, fuse_adjacent_backwards, stage_owners)
from .engine import ZeroSpeedEngine

__all__ = ["PipelineEngine", "reduction_window"]


def reduction_window(actions: list) -> int | None:
    """Index of the first action of the trailing run of weight-gradient passes (`Backward` or
    `BackwardWeight`) that are each the last one of their model stage on this rank: the data-parallel
    reduction is armed there, so every parameter gets exactly one gradient while armed. None without any
    weight-gradient pass. 1F1B: the last micro-batch's backward."""
    passes = [(i, a.stage) for i, a in enumerate(actions) if isinstance(a, (Backward, BackwardWeight))]
    last = {stage: i for i, stage in passes}
    start = None
    for i, stage in reversed(passes):
        if last[stage] != i:
            break
        start = i
    return start


class PipelineEngine(ZeroSpeedEngine):
    """The engine for a `PipelineModule` (built by `zerospeed.initialize`). Use `train_batch(data_iter)`;
    `forward`, `backward` and `step` raise (as DeepSpeed's PipelineEngine)."""

    def _init_pipeline(self, pipe_group, schedule: str = "1f1b", ties=None, split_backward: bool = False) -> None:
        self.pipe_group = pipe_group
        self._ties = ties
        if ties:
            ties.logger = self.comms_logger
        self.num_stages, self.stage_id = self.module.num_stages, self.module.stage_id
        self.micro_batches = self._gas
        self.data_iterator = None
        self.batch_fn = None
        self.schedule_name = schedule
        module = self.module
        plan = build_schedule(schedule, self.num_stages, self.micro_batches, chunks=module.chunks,
                              layout=module.chunk_layout)
        self._rank_of = stage_owners(plan)  # model stage -> pipe rank
        if any(module.stage_rank(s) != r for s, r in self._rank_of.items()):
            raise RuntimeError(f"schedule {schedule!r} places model stages {self._rank_of} differently from the "
                               f"PipelineModule's layout {module.chunk_layout!r}")
        # without split_backward a B followed at once by its own W runs as one fused backward (no timing changes
        # but this rank's own: cheaper where fused costs less, bf16 here)
        self._actions = plan[self.stage_id] if split_backward else fuse_adjacent_backwards(plan[self.stage_id])
        self._split_all = split_backward
        self._split_keys = {(a.microbatch, a.stage) for a in self._actions if isinstance(a, BackwardInput)}
        self._window = reduction_window(self._actions)
        self._last_model_stage = len(self._rank_of) - 1
        self._link = ActivationLink(pipe_group, self.device, self.stage_id, self.comms_logger,
                                    dynamic_shape=module.dynamic_shape)

    # -- DeepSpeed's accessors ------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        """Whether this rank holds the first model stage (it reads the inputs)."""
        return self.module.is_first_stage()

    def is_last_stage(self) -> bool:
        """Whether this rank holds the last model stage (it reads the labels and computes the loss)."""
        return self.module.is_last_stage()

    def set_dataiterator(self, iterator) -> None:
        """The iterator `train_batch()` reads when called without one (first and last stage; the others read
        nothing and ignore it), as DeepSpeed's."""
        self.training_dataloader = None
        self.data_iterator = iterator

    def set_dataloader(self, loader) -> None:
        """Read `train_batch()`'s micro-batches from `iter(loader)` (first and last stage), as DeepSpeed's. With
        `initialize(training_data=...)` the engine sets a `RepeatingLoader` over the dataset in order (no shuffle),
        this rank's data-parallel share of it (a `DistributedSampler` over the data-parallel group), as
        DeepSpeed's pipeline engine does."""
        self.training_dataloader = loader
        self.data_iterator = iter(loader)

    def set_batch_fn(self, fn) -> None:
        """Apply `fn` to every micro-batch read from the data iterator (on the stages that read data), as
        DeepSpeed's."""
        self.batch_fn = fn

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) instead of "
                           "engine(batch) / engine.backward / engine.step")

    def backward(self, *args, **kwargs):
        self.forward()

    def step(self, *args, **kwargs):
        self.forward()

    # -- one batch ----------------------------------------------------------------------------------
    def _read_batch(self, it, m: int, call: str = "train_batch") -> list:
        """The batch's `m` micro-batches, read up front on the stages that load data (else [])."""
        if not (self.is_first_stage() or self.is_last_stage()):
            return []
        if it is None:
            raise ValueError(f"{call}() needs a data iterator on the first and last stage: pass "
                             f"{call}(data_iter) or call engine.set_dataiterator(...)")
        fetched = []
        for i in range(m):
            try:
                batch = next(it)
            except StopIteration:
                raise RuntimeError(f"the data iterator ran dry at micro-batch {i} of {m} (stage {self.stage_id}); "
                                   f"give it at least {m} micro-batches per train_batch") from None
            fetched.append(self.batch_fn(batch) if self.batch_fn is not None else batch)
        return fetched

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Run one global batch (`micro_batches` micro-batches through every stage) and step. Collective over
        the world. Returns the mean loss over the micro-batches and data-parallel ranks, the same 0-d tensor
        on every rank. Raises ValueError without a data iterator on the first or last stage, RuntimeError
        when it runs dry mid-batch (naming the micro-batch)."""
        if data_iter is not None:  # kept for the next train_batch() without one, as DeepSpeed's
            self.set_dataiterator(data_iter)
        fetched = self._read_batch(self.data_iterator, self.micro_batches)
        self.module.train()
        losses, _ = self._execute(self._actions, fetched, self.micro_batches, train=True)
        return self._batch_loss([loss.float() for loss in losses])

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None):
        """Forward `num_micro_batches` (default `micro_batches`) micro-batches through every stage under
        `module.eval()` and `torch.no_grad()` (DeepSpeed's `PipelineEngine.eval_batch`, same arguments). On the
        last stage each micro-batch gives `loss_fn(output, labels)` (or the output itself without a loss_fn or
        with compute_loss=False); reduce_output="avg" averages them over the micro-batches and the data-parallel
        ranks, None returns the list. With bcast_loss (and an averaged 0-d result) every stage returns that
        value, else the other stages return None. return_logits: also return the last micro-batch's output on
        the last stage (None elsewhere), as `(result, logits)`. Collective over the world. Raises ValueError
        for another reduce_output, or a micro-batch count the schedule does not take."""
        if reduce_output is not None and reduce_output.lower() != "avg":
            raise ValueError(f"reduce_output={reduce_output!r}: only 'avg' or None are supported (as in DeepSpeed)")
        m = self.micro_batches if num_micro_batches is None else num_micro_batches
        plan = build_schedule(self.schedule_name, self.num_stages, m, chunks=self.module.chunks,
                              layout=self.module.chunk_layout)[self.stage_id]
        forwards = [a for a in plan if isinstance(a, (LoadMicroBatch, RecvActivation, Forward, SendActivation))]
        fetched = self._read_batch(data_iter, m, "eval_batch")
        self.module.eval()
        with torch.no_grad():
            results, logits = self._execute(forwards, fetched, m, train=False, compute_loss=compute_loss)
        out = None
        if self.is_last_stage():
            out = results
            if reduce_output is not None:
                out = sum(results) / m
                if self.dp_world_size > 1:
                    all_reduce(out, group=self.group, logger=self.comms_logger)
                    out /= self.dp_world_size
        if compute_loss and bcast_loss and reduce_output is not None:
            t = out.float().reshape(()) if out is not None else torch.zeros((), dtype=torch.float32, device=self.device)
            broadcast(t, self._rank_of[self._last_model_stage], group=self.pipe_group, logger=self.comms_logger)
            out = t
        return (out, logits) if return_logits else out

    def _execute(self, actions: list, fetched: list, m: int, *, train: bool, compute_loss: bool = True):
        """Run `actions` (this rank's part of a schedule) on the micro-batches `fetched`. Returns the last model
        stage's per-micro-batch losses (detached; the outputs when not computing a loss) and the last output."""
        inputs, outputs, targets, grads, pending, labels, results = {}, {}, {}, {}, {}, {}, []
        last, link, last_out = self._last_model_stage, self._link, None
        ahead = ReceiveAhead(actions, link, self._rank_of)
        for i, a in enumerate(actions):
            key = (getattr(a, "microbatch", None), getattr(a, "stage", None))
            if isinstance(a, COMPUTE):
                ahead.before(i, outputs)  # the next computation's messages may arrive during this one
            if isinstance(a, LoadMicroBatch):
                batch = fetched[a.microbatch]
                x, y = batch if isinstance(batch, (tuple, list)) and len(batch) == 2 else (batch, None)
                if a.stage == 0:
                    inputs[key] = _to(x, self.device)
                if a.stage == last:
                    labels[a.microbatch] = None if y is None else _to(y, self.device)
            elif isinstance(a, RecvActivation):
                inputs[key] = link.recv_activation(self._rank_of[a.peer])
                ahead.taken(i)
            elif isinstance(a, Forward):
                if key not in inputs:  # the previous model stage is on this rank: its output, detached
                    inputs[key] = detach_input(outputs.pop((a.microbatch, a.stage - 1)))
                run = self.module
                split = train and (self._split_all or key in self._split_keys)
                out, segments = run.forward_segments(inputs[key], a.stage) if split else \
                    (run.forward_chunk(a.stage, inputs[key]), None)
                target = out
                if a.stage == last:
                    y = labels.pop(a.microbatch)
                    loss = run.loss_fn(out, y) if run.loss_fn is not None and compute_loss else out
                    results.append(loss.detach())
                    last_out = out
                    if train:
                        target = self.loss_scaler.scale(loss / m)
                        if segments:
                            segments[-1].output = target
                if train:
                    targets[key] = segments if split else target
                else:
                    inputs.pop(key)  # no backward will need it
                if a.stage != last:
                    outputs[key] = out  # sent on, and the shape of the gradient to receive
            elif isinstance(a, SendActivation):
                link.send_activation(outputs[key] if train else outputs.pop(key), self._rank_of[a.peer])
            elif isinstance(a, RecvGrad):
                grads[key] = link.recv_grads(outputs.pop(key), self._rank_of[a.peer])
                ahead.taken(i)
            elif isinstance(a, Backward):
                self._before_weights(i)
                target, grad = targets.pop(key), grads.pop(key, None)
                if self._split_all:  # split_backward: both passes back to back (its forward ran as segments)
                    backward_weight(backward_input(target, grad)[0])
                else:
                    backward_fused(target, grad)
                self._after_weights(i)
                self._input_grads_done(key, inputs, grads)
            elif isinstance(a, BackwardInput):
                pending[key], _ = backward_input(targets.pop(key), grads.pop(key, None))
                self._input_grads_done(key, inputs, grads)
            elif isinstance(a, BackwardWeight):
                self._before_weights(i)
                backward_weight(pending.pop(key))
                self._after_weights(i)
            elif isinstance(a, SendGrad):
                link.send_grads(inputs.pop(key), self._rank_of[a.peer])
            elif isinstance(a, ReduceTiedGrads):
                pass  # done after the data-parallel reduction (ReduceGrads): the two sums commute
            elif isinstance(a, ReduceGrads):
                link.wait_sends()
                if self.strategy.phase.value == "armed":
                    self.strategy.finish()
                if self._ties:
                    self._ties.reduce_grads(self.strategy, self.group)
            elif isinstance(a, OptimizerStep):
                self._optimizer_step()
        link.wait_sends()
        return results, last_out

    def _input_grads_done(self, key, inputs: dict, grads: dict) -> None:
        """After a backward produced the gradient of model stage key[1]'s input: the first stage drops the
        micro-batch; when the previous model stage is on this rank, the gradient goes to it directly (no
        message); else it waits in `inputs` for SendGrad."""
        mb, stage = key
        if stage == 0:
            inputs.pop(key, None)
        elif self._rank_of[stage - 1] == self.stage_id:
            xs = as_tuple(inputs.pop(key))
            grads[(mb, stage - 1)] = tuple(
                (t.grad if t.grad is not None else torch.zeros_like(t)) if t.is_floating_point() else None for t in xs)

    def _before_weights(self, index: int) -> None:
        """Arm the data-parallel reduction before a weight-gradient pass (see the module docstring)."""
        if index == self._window or (self.strategy.reduce_every_micro_step and index < self._window):
            self.strategy.arm()

    def _after_weights(self, index: int) -> None:
        if self.strategy.reduce_every_micro_step and index < self._window:
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
        broadcast(t, self._rank_of[self._last_model_stage], group=self.pipe_group, logger=self.comms_logger)
        return t


def _to(x, device):
    """A micro-batch's tensor, or tuple/list of tensors, on `device`."""
    if isinstance(x, (tuple, list)):
        return tuple(t.to(device) if torch.is_tensor(t) else t for t in x)
    return x.to(device)
