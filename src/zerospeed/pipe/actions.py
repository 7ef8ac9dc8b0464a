"""The vocabulary of pipeline schedules (`pipe.schedule`): actions as small frozen dataclasses, and how the
messages between ranks are placed around the computations (`with_communication`).

Vocabulary and DeepSpeed's instructions (deepspeed/runtime/pipe/schedule.py, ``TrainSchedule``).
DeepSpeed addresses activation *buffers* (``buffer_id = micro_batch % num_pipe_buffers()``); these
actions address micro-batches and leave buffer reuse to the executor:

=========================================  =======================================================
zerospeed action                           DeepSpeed instruction
=========================================  =======================================================
``LoadMicroBatch(mb, stage)``              ``LoadMicroBatch(buffer_id)`` (first stage: inputs,
                                           last stage: labels)
``Forward(mb, stage)``                     ``ForwardPass(buffer_id)``
``Backward(mb, stage)``                    ``BackwardPass(buffer_id)`` (input + weight gradients)
``BackwardInput(mb, stage)``               none: the input-gradient half of ``BackwardPass``
``BackwardWeight(mb, stage)``              none: the deferred weight-gradient half (zero bubble)
``SendActivation(mb, stage, peer)``        ``SendActivation(buffer_id)`` (to ``stage + 1``)
``RecvActivation(mb, stage, peer)``        ``RecvActivation(buffer_id)`` (from ``stage - 1``)
``SendGrad(mb, stage, peer)``              ``SendGrad(buffer_id)`` (to ``stage - 1``)
``RecvGrad(mb, stage, peer)``              ``RecvGrad(buffer_id)`` (from ``stage + 1``)
``ReduceTiedGrads()``                      ``ReduceTiedGrads()``
``ReduceGrads()``                          ``ReduceGrads()``
``OptimizerStep()``                        ``OptimizerStep()``
=========================================  =======================================================

In ``Send*``/``Recv*`` ``stage`` is the local (this rank's) model stage and ``peer`` the remote one.
Sends are placed right after the computation that produces them and receives right before the one
that needs them (torch.distributed.pipelining's ``_add_send_recv`` does the same), or earlier where
a peer rank sent an earlier message that must be received first (messages between two ranks match
in order); a message between two stages on the same rank is not sent at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Forward:
    """Forward pass of ``microbatch`` through model stage ``stage``."""
    microbatch: int
    stage: int


@dataclass(frozen=True)
class Backward:
    """Fused backward (input and weight gradients) of ``microbatch`` on ``stage``; DeepSpeed's."""
    microbatch: int
    stage: int


@dataclass(frozen=True)
class BackwardInput:
    """Input-gradient pass ("B" in Qi et al. 2024): frees the activations, sends the gradient on."""
    microbatch: int
    stage: int


@dataclass(frozen=True)
class BackwardWeight:
    """Weight-gradient pass ("W" in Qi et al. 2024), after ``BackwardInput`` of the same pair."""
    microbatch: int
    stage: int


@dataclass(frozen=True)
class SendActivation:
    """Send ``stage``'s output for ``microbatch`` to model stage ``peer`` (= stage + 1)."""
    microbatch: int
    stage: int
    peer: int


@dataclass(frozen=True)
class RecvActivation:
    """Receive ``stage``'s input for ``microbatch`` from model stage ``peer`` (= stage - 1)."""
    microbatch: int
    stage: int
    peer: int


@dataclass(frozen=True)
class SendGrad:
    """Send the gradient of ``stage``'s input for ``microbatch`` to model stage ``peer`` (= stage - 1)."""
    microbatch: int
    stage: int
    peer: int


@dataclass(frozen=True)
class RecvGrad:
    """Receive the gradient of ``stage``'s output for ``microbatch`` from ``peer`` (= stage + 1)."""
    microbatch: int
    stage: int
    peer: int


@dataclass(frozen=True)
class LoadMicroBatch:
    """Pull ``microbatch`` from the data iterator: inputs on the first stage, labels on the last."""
    microbatch: int
    stage: int


@dataclass(frozen=True)
class ReduceTiedGrads:
    """All-reduce the gradients of layers tied across stages (DeepSpeed's ``ReduceTiedGrads``)."""


@dataclass(frozen=True)
class ReduceGrads:
    """Reduce gradients over the data-parallel group (DeepSpeed's ``ReduceGrads``)."""


@dataclass(frozen=True)
class OptimizerStep:
    """Step the optimizer once the batch's gradients are complete (DeepSpeed's ``OptimizerStep``)."""


COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)
MARKERS = (LoadMicroBatch, ReduceTiedGrads, ReduceGrads, OptimizerStep)
Action = Union[Forward, Backward, BackwardInput, BackwardWeight, SendActivation, RecvActivation,
               SendGrad, RecvGrad, LoadMicroBatch, ReduceTiedGrads, ReduceGrads, OptimizerStep]
Schedule = dict[int, list[Action]]


def _check_sizes(num_stages: int, num_microbatches: int, chunks: int = 1) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def stage_owners(schedule: Schedule) -> dict[int, int]:
    """Model stage -> rank, read off the compute actions.

    Raises ValueError if one model stage is computed on two ranks (name both ranks and the action).
    """
    owner: dict[int, int] = {}
    for rank in sorted(schedule):
        for action in schedule[rank]:
            if isinstance(action, COMPUTE):
                seen = owner.setdefault(action.stage, rank)
                if seen != rank:
                    raise ValueError(f"rank {rank}: {action} computes model stage {action.stage}, which rank "
                                     f"{seen} computes too; each model stage must live on exactly one rank")
    return owner


def with_communication(orders: dict[int, list[Action]], num_model_stages: int) -> Schedule:
    """Add loads, sends, receives and the end-of-batch markers to per-rank compute orders.

    ``orders`` holds only compute actions. A receive goes right before the computation that needs a
    remote input (or earlier, to keep each peer's send order), a send right after the one that
    produces a remote output; ``LoadMicroBatch`` before each forward of the first and last model
    stage (DeepSpeed loads labels on the last stage); every rank ends with ``ReduceTiedGrads,
    ReduceGrads, OptimizerStep`` as ``TrainSchedule``'s last step. Raises ValueError if a model
    stage is computed on two ranks.
    """
    owner = stage_owners(orders)
    last = num_model_stages - 1
    schedule: Schedule = {}
    for rank, order in orders.items():
        out: list[Action] = []
        for a in order:
            mb, s = a.microbatch, a.stage
            if isinstance(a, Forward):
                if s > 0 and owner.get(s - 1) != rank:
                    out.append(RecvActivation(mb, s, s - 1))
                if s in (0, last):
                    out.append(LoadMicroBatch(mb, s))
                out.append(a)
                if s < last and owner.get(s + 1) != rank:
                    out.append(SendActivation(mb, s, s + 1))
            elif isinstance(a, (Backward, BackwardInput)):
                if s < last and owner.get(s + 1) != rank:
                    out.append(RecvGrad(mb, s, s + 1))
                out.append(a)
                if s > 0 and owner.get(s - 1) != rank:
                    out.append(SendGrad(mb, s, s - 1))
            else:
                out.append(a)
        out += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        schedule[rank] = out
    return _receive_in_send_order(schedule, owner)


def message_key(a: Action) -> tuple:
    """(kind, micro-batch, source stage, destination stage) of a send or receive."""
    if isinstance(a, (SendActivation, SendGrad)):
        return ("activation" if isinstance(a, SendActivation) else "grad", a.microbatch, a.stage, a.peer)
    return ("activation" if isinstance(a, RecvActivation) else "grad", a.microbatch, a.peer, a.stage)


def _receive_in_send_order(schedule: Schedule, owner: dict[int, int]) -> Schedule:
    """Move receives earlier so each rank receives from each peer rank in that peer's send order.

    Point-to-point messages between two ranks match in order. When a rank needs a message that its
    peer sent after another one (ZB-V: rank 0 sends micro-batch 2's activation before micro-batch
    0's gradient, rank 1 needs the gradient first), the earlier message's receive moves up to just
    before the needed one. It costs nothing in the simulator: the earlier message was sent first.
    """
    sent: dict[tuple[int, int], list[tuple]] = {}
    for rank, actions in schedule.items():
        for a in actions:
            if isinstance(a, (SendActivation, SendGrad)):
                sent.setdefault((rank, owner[a.peer]), []).append(message_key(a))
    out: Schedule = {}
    for rank, actions in schedule.items():
        queues = {src: list(msgs) for (src, dst), msgs in sent.items() if dst == rank}
        moved: set = set()
        new: list[Action] = []
        for a in actions:
            if isinstance(a, (RecvActivation, RecvGrad)):
                if a in moved:
                    continue
                queue, key = queues.get(owner.get(a.peer), []), message_key(a)
                if key in queue:
                    for kind, mb, src, dst in queue[:queue.index(key)]:
                        early = (RecvActivation if kind == "activation" else RecvGrad)(mb, dst, src)
                        new.append(early)
                        moved.add(early)
                    del queue[:queue.index(key) + 1]
            new.append(a)
        out[rank] = new
    return out


def fuse_adjacent_backwards(actions: list[Action]) -> list[Action]:
    """One rank's actions with each ``BackwardInput(mb, s)`` that is followed at once by its own
    ``BackwardWeight(mb, s)`` replaced by one ``Backward(mb, s)``.

    Only pairs with nothing between them are fused: the input-gradient pass sends no message to another
    rank (a ``SendGrad`` would sit between) and nothing runs between the two, so the fused backward changes
    no rank's timing but its own; where the fused backward costs less than the two passes (bf16 on this CPU:
    122 ms against 131 per GPT micro-batch) the rank gets that much faster. ZB-V on 2 ranks and 8
    micro-batches fuses 8 of rank 0's 16 pairs and 7 of rank 1's; ZB-H1 every pair of the first stage.
    """
    out: list[Action] = []
    i = 0
    while i < len(actions):
        a = actions[i]
        if isinstance(a, BackwardInput) and i + 1 < len(actions) \
                and actions[i + 1] == BackwardWeight(a.microbatch, a.stage):
            out.append(Backward(a.microbatch, a.stage))
            i += 2
            continue
        out.append(a)
        i += 1
    return out
