"""Activations and their gradients between neighbouring pipeline stages, as point-to-point messages.

A stage's output is a tensor or a tuple of tensors (DeepSpeed's pipeline passes both). The first time a stage
sends to a peer, it sends a header describing the activation: ``[count, (dtype index, ndim, *shape) x count]``
(preceded by its length); the receiver caches it, so every later micro-batch is one message per tensor
(DeepSpeed's ``_send_tensor_meta`` / ``_recv_tensor_meta`` exchange, done once per link as its
``pipe_recv_buf``). Every micro-batch must then have the same shapes and dtypes; a change is an error
naming the stage, unless the module was built with ``dynamic_shape=True`` (DeepSpeed's flag): then every
activation is preceded by its header's length, 0 when nothing changed, so shapes may vary per micro-batch. Gradients flow back for the floating-point tensors only (integer tensors, such as masks
or token ids, pass forward without gradients), in tuple order; a floating input that took no part in the
backward sends zeros. Messages between two ranks match in posting order (gloo and NCCL both), so one
header per direction and link is enough.
"""
from __future__ import annotations

from typing import Union

import torch

from collections import deque

from ..comm.logger import CommsLogger
from ..comm.ops import CommHandle, recv, start_recv, start_send
from .schedule import COMPUTE, RecvActivation, RecvGrad

__all__ = ["Activation", "ActivationLink", "ReceiveAhead", "as_tuple", "from_tuple", "floating"]

Activation = Union[torch.Tensor, tuple]

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]


def as_tuple(x: Activation) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def from_tuple(xs: tuple, like_tuple: bool) -> Activation:
    return xs if like_tuple else xs[0]


def floating(xs: tuple) -> list[int]:
    """Positions of the floating-point tensors of a tuple: those whose gradients go back."""
    return [i for i, t in enumerate(xs) if t.is_floating_point()]


class ActivationLink:
    """One stage's messages to and from its pipeline neighbours over `group` (ranks in that group).

    `send_activation(x, peer)` / `recv_activation(peer)` move a forward activation (tensor or tuple);
    `send_grads(inputs, peer)` / `recv_grads(outputs, peer)` move the gradients of its floating tensors back.
    `stage` names the model stage in error messages. Sends are asynchronous: their handles collect in
    `pending` until `wait_sends()`.
    """

    def __init__(self, group, device: torch.device, stage: int, logger: CommsLogger | None = None, *,
                 dynamic_shape: bool = False):
        self.group, self.device, self.stage, self.logger = group, device, stage, logger
        self.dynamic_shape = dynamic_shape  # a header with every activation (DeepSpeed's dynamic_shape)
        self.pending: list[CommHandle] = []
        self._sent: dict[int, tuple] = {}      # peer -> (is tuple, ((shape, dtype), ...)) sent in the header
        self._expected: dict[int, tuple] = {}  # peer -> the header received from it
        self._posted: dict[int, deque] = {}    # peer -> receives posted ahead, in posting order
        self.received_ahead = 0                # messages taken from receives posted ahead (a statistic)

    def _send(self, t: torch.Tensor, peer: int) -> None:
        self.pending.append(start_send(t.contiguous(), peer, group=self.group, logger=self.logger))

    def _recv(self, shape, dtype, peer: int) -> torch.Tensor:
        return recv(torch.empty(shape, dtype=dtype, device=self.device), peer, group=self.group, logger=self.logger)

    def wait_sends(self) -> None:
        for h in self.pending:
            h.wait()
        self.pending = []

    def send_activation(self, x: Activation, peer: int) -> None:
        xs = as_tuple(x)
        bad = [type(t).__name__ for t in xs if not torch.is_tensor(t)]
        if bad:
            raise TypeError(f"pipeline stage {self.stage} returned a {type(x).__name__} holding {', '.join(bad)}: "
                            "only a tensor or a tuple of tensors can pass between stages")
        meta = (isinstance(x, tuple), tuple((tuple(t.shape), t.dtype) for t in xs))
        sent = self._sent.get(peer)
        if sent is None or (self.dynamic_shape and meta != sent):  # tell the peer what to expect
            head = [len(xs)]
            for t in xs:
                if t.dtype not in _DTYPES:
                    raise TypeError(f"pipeline stage {self.stage} sends a {t.dtype} tensor; supported dtypes: "
                                    f"{', '.join(str(d) for d in _DTYPES)}")
                head += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
            head = torch.tensor([int(meta[0])] + head, dtype=torch.int64)
            self._send(torch.tensor([head.numel()], dtype=torch.int64), peer)
            self._send(head, peer)
            self._sent[peer] = meta
        elif self.dynamic_shape:
            self._send(torch.zeros(1, dtype=torch.int64), peer)  # header length 0: the same shapes as before
        elif meta != sent:
            raise RuntimeError(f"pipeline stage {self.stage} produced an activation {_describe(meta)}, but earlier "
                               f"micro-batches had {_describe(sent)}: every micro-batch must have the same shapes "
                               "and dtypes (pad or drop the last batch), or build the PipelineModule with "
                               "dynamic_shape=True")
        for t in xs:
            self._send(t.detach(), peer)

    def can_post_activation(self, peer: int) -> bool:
        """Whether the next activation from `peer` can be received ahead: its shapes are known."""
        return not self.dynamic_shape and peer in self._expected

    def post_activation(self, peer: int) -> None:
        """Post the receives of the next activation from `peer` now (`recv_activation` then waits for them)."""
        meta = self._expected[peer]
        bufs = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta[1])
        handles = [start_recv(b, peer, group=self.group, logger=self.logger) for b in bufs]
        self._posted.setdefault(peer, deque()).append(("activation", meta[0], bufs, handles))

    def post_grads(self, outputs: Activation, peer: int) -> None:
        """Post the receives of the gradients of `outputs` from `peer` now (`recv_grads` then waits)."""
        xs = as_tuple(outputs)
        bufs = tuple(torch.empty_like(t) if t.is_floating_point() else None for t in xs)
        handles = [start_recv(b, peer, group=self.group, logger=self.logger) for b in bufs if b is not None]
        self._posted.setdefault(peer, deque()).append(("grad", None, bufs, handles))

    def _take_posted(self, peer: int, kind: str):
        queue = self._posted.get(peer)
        if not queue:
            return None
        got, is_tuple, bufs, handles = queue.popleft()
        if got != kind:  # the executor posts in the schedule's order: a bug, never a user error
            raise RuntimeError(f"pipeline stage {self.stage}: expected a posted {kind} receive from {peer}, found {got}")
        for h in handles:
            h.wait()
        self.received_ahead += 1
        return is_tuple, bufs

    def recv_activation(self, peer: int) -> Activation:
        """The next activation from `peer`: fresh leaf tensors, the floating ones requiring grad."""
        posted = self._take_posted(peer, "activation")
        if posted is not None:
            is_tuple, bufs = posted
            return from_tuple(tuple(b.requires_grad_(b.is_floating_point()) for b in bufs), is_tuple)
        meta = self._expected.get(peer)
        n = self._recv((1,), torch.int64, peer) if meta is None or self.dynamic_shape else 0
        if int(n):
            head = self._recv((int(n),), torch.int64, peer).tolist()
            is_tuple, count, pos, specs = bool(head[0]), head[1], 2, []
            for _ in range(count):
                dtype, ndim = _DTYPES[head[pos]], head[pos + 1]
                specs.append((tuple(head[pos + 2:pos + 2 + ndim]), dtype))
                pos += 2 + ndim
            meta = self._expected[peer] = (is_tuple, tuple(specs))
        xs = tuple(self._recv(shape, dtype, peer).requires_grad_(dtype.is_floating_point) for shape, dtype in meta[1])
        return from_tuple(xs, meta[0])

    def send_grads(self, inputs: Activation, peer: int) -> None:
        """Send back the gradients of `inputs`' floating tensors (zeros where a tensor got none)."""
        xs = as_tuple(inputs)
        for i in floating(xs):
            self._send(xs[i].grad if xs[i].grad is not None else torch.zeros_like(xs[i]), peer)

    def recv_grads(self, outputs: Activation, peer: int) -> tuple:
        """The gradients of `outputs`' floating tensors from `peer`, one per tensor of `outputs` (None for
        the others), as a tuple."""
        posted = self._take_posted(peer, "grad")
        if posted is not None:
            return posted[1]
        xs = as_tuple(outputs)
        grads: list = [None] * len(xs)
        for i in floating(xs):
            grads[i] = self._recv(tuple(xs[i].shape), xs[i].dtype, peer)
        return tuple(grads)


def _describe(meta: tuple) -> str:
    is_tuple, specs = meta
    inner = ", ".join(f"{list(shape)} {dtype}" for shape, dtype in specs)
    return f"({inner})" if is_tuple else inner


class ReceiveAhead:
    """Posts a schedule's receives ahead of the action that takes them, so a message can arrive while this rank
    computes. Before each computation, `before(i, outputs)` posts, in the schedule's order, the receives
    between it and the next computation, stopping at the first whose shapes are not known yet (the first
    activation of a link, whose header comes first; a gradient whose forward has not run; any activation
    under dynamic_shape). In order, because point-to-point messages between two ranks match in posting order.
    `rank_of` maps model stages to pipe ranks, as the executor's."""

    def __init__(self, actions: list, link: ActivationLink, rank_of: dict[int, int]):
        self.actions, self.link, self.rank_of = actions, link, rank_of
        self.next = 0  # the first receive not posted or taken yet

    def before(self, index: int, outputs: dict) -> None:
        k = max(self.next, index + 1)
        while k < len(self.actions) and not isinstance(self.actions[k], COMPUTE):
            a = self.actions[k]
            if isinstance(a, RecvActivation):
                if not self.link.can_post_activation(self.rank_of[a.peer]):
                    return
                self.link.post_activation(self.rank_of[a.peer])
            elif isinstance(a, RecvGrad):
                out = outputs.get((a.microbatch, a.stage))
                if out is None:
                    return
                self.link.post_grads(out, self.rank_of[a.peer])
            k += 1
            self.next = k

    def taken(self, index: int) -> None:
        """The receive at `index` ran (posted ahead or not)."""
        self.next = max(self.next, index + 1)
