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

from ..comm.logger import CommsLogger
from ..comm.ops import CommHandle, recv, start_send

__all__ = ["Activation", "ActivationLink", "as_tuple", "from_tuple", "floating"]

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

    def recv_activation(self, peer: int) -> Activation:
        """The next activation from `peer`: fresh leaf tensors, the floating ones requiring grad."""
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
        xs = as_tuple(outputs)
        grads: list = [None] * len(xs)
        for i in floating(xs):
            grads[i] = self._recv(tuple(xs[i].shape), xs[i].dtype, peer)
        return tuple(grads)


def _describe(meta: tuple) -> str:
    is_tuple, specs = meta
    inner = ", ".join(f"{list(shape)} {dtype}" for shape, dtype in specs)
    return f"({inner})" if is_tuple else inner
