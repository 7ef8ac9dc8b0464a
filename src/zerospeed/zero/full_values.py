"""Full parameter values one at a time, for writing them out (`ZeroStrategy.full_values`,
`engine.save_16bit_model`): the protocol, and its implementation for strategies that hold every value whole
(stages 0-2); stage 3 gathers (`stage3_checkpoint.py`)."""
from __future__ import annotations

import torch


class FullValues:
    """Full values of `tensors` for writing them out one at a time (`ZeroStrategy.full_values`).

    order: indices into `tensors` in the order to read them (the same on every rank). shape(i): the
    full shape of tensors[i] (known before any gathering). value(i): its full value, detached, valid
    until the next value() call; call in `order`. finish(): take part in every collective still due
    (ranks that do not write call it instead of value(); a writer calls it after a failure, so the
    other ranks do not hang). close() (or leaving the `with`): release what is held. This base class
    is for strategies holding every value whole: value(i) is tensors[i] itself, nothing is collective.
    """

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = list(tensors)
        self.order = list(range(len(self.tensors)))

    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.tensors[i].shape)

    def value(self, i: int) -> torch.Tensor:
        return self.tensors[i].detach()

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> FullValues:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
