"""ZeRO-Infinity's gradient tier: each master's fp32 gradient written to NVMe as it is produced.

ZeRO-Infinity, Rajbhandari et al. 2021, §5.1: with the optimizer states on NVMe, the gradient
partition (4 bytes x Ψ/N per rank in fp32) is the last model state whose size grows with the model
and still sits in host memory between the backward and the step. DeepSpeed swaps the fp32 gradients
of each sub-group out into the optimizer's swap files (`swap_out_gradients`) and reads them back
tile by tile during the step; so do we. A stage-3 unit's gradient is written the moment its
reduce-scatter finished (at every micro-step: a later micro-step reads it back, adds and writes it
again), and the optimizer step reads each tile's rows next to its master and states. Under bf16/fp16
the first micro-step's gradient is written as it was reduced, in 2 bytes per element (with its
divisor `post`), and turned into fp32 when read, as the in-memory path keeps it until the step: half
the gradient I/O and disk (the paper's 2Ψ/N gradient partition) and the same numbers.

What stays in memory: the gradient being written (one master's; `max_inflight` allows more) and one
8-byte sum of squares per master for the global norm (computed by the caller, `zero.clipping.sum_of_squares`, when it writes), so
clipping never reads the gradients back. The clip coefficient and the loss-scale division are kept
as `scales` and applied to each tile when the step reads it, in the order the in-memory path applies
them (the same fp32 roundings).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .aio import IOHandle
from .hostmem import recycled
from .swap import SwapSpace

__all__ = ["SwappedGrads", "widen_into"]


class SwappedGrads:
    """fp32 gradients of the masters (keyed by master index m) in `swap`, one file per master.

    dtype: the gradients' dtype (the masters', fp32). max_inflight: bytes of older gradients whose write
    may still be running besides the newest one (their buffers stay alive until then); default 0: the
    previous write is waited for when the next one starts (the backward of one unit hides the write
    of the one before it).
    """

    def __init__(self, swap: SwapSpace, *, dtype: torch.dtype = torch.float32, max_inflight: int = 0):
        self.swap, self.dtype, self.max_inflight = swap, dtype, max_inflight
        self.squares: dict[int, torch.Tensor] = {}  # m -> sum of squares of its current gradient (float64 [1])
        self.low: dict[int, tuple[torch.dtype, float]] = {}  # m -> (2-byte dtype, post) of a gradient stored so
        self.writes: OrderedDict[int, tuple[IOHandle, torch.Tensor]] = OrderedDict()
        self.scales: list = []  # multipliers (float or 0-d tensor) applied in order when the step reads a tile
        # super_offload: a `BackwardSteps` that steps master m in the backward instead of writing its gradient
        # (`takes(m)`, `submit(m, grad)`), set for the boundary micro-step only; the masters it took
        self.consumer = None
        self.consumed: set[int] = set()

    @staticmethod
    def key(m: int) -> str:
        return f"grad_m{m}"

    def buffer(self, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An aligned host buffer [numel] (default dtype: fp32) to compute a gradient into before `write`."""
        return recycled.empty(numel, dtype or self.dtype)

    def has(self, m: int) -> bool:
        """Master m has a gradient this step (written since the last `clear`)."""
        return m in self.squares

    def write(self, m: int, grad: torch.Tensor, squares: torch.Tensor, post: float | None = None) -> None:
        """Start writing master m's whole gradient `grad` (1-D host tensor of the master's numel, from
        `buffer()`; not to be modified until written) with its sum of squares `squares` (of its fp32
        value). post: `grad` is a 2-byte gradient whose value is grad.float() x (1 / post)."""
        self._wait(m)
        self.squares[m] = squares
        if post is None:
            self.low.pop(m, None)
        else:
            self.low[m] = (grad.dtype, post)
        self.writes[m] = (self.swap.write(self.key(m), grad), grad)
        while len(self.writes) > 1 and self.inflight_bytes() > self.max_inflight:
            self._wait(next(iter(self.writes)))

    def consume(self, m: int, grad: torch.Tensor, squares: torch.Tensor) -> None:
        """Hand master m's final fp32 gradient `grad` to `consumer` (it steps now; nothing is written) and
        keep its sum of squares for the norm. Raises RuntimeError without a consumer."""
        if self.consumer is None:
            raise RuntimeError("SwappedGrads.consume() without a consumer")
        self._wait(m)
        self.squares[m] = squares
        self.low.pop(m, None)
        self.consumed.add(m)
        self.consumer.submit(m, grad)

    def read(self, m: int, numel: int) -> torch.Tensor | None:
        """Master m's gradient as a fresh host tensor [numel] (read now, unscaled), or None if it has none."""
        if not self.has(m):
            return None
        out = self.buffer(numel)
        self.read_rows(m, 0, out).wait()
        return out

    def read_rows(self, m: int, start: int, into: torch.Tensor):
        """Start reading master m's gradient elements [start, start + into.numel()) into `into` (an fp32
        buffer view); returns a handle whose wait() leaves the fp32 values there (a 2-byte gradient is
        read into a staging buffer and converted). The caller checks `has(m)` first. Raises RuntimeError
        for a gradient the optimizer already consumed in the backward (super_offload)."""
        if m in self.consumed:
            raise RuntimeError(f"the gradient of optimizer master {m} was consumed by the step during the backward "
                               "(offload_optimizer.super_offload): it is not kept after the optimizer used it")
        self._wait(m)
        if m not in self.low:
            return self.swap.read(self.key(m), into, start * into.element_size())
        dtype, post = self.low[m]
        stage = recycled.empty(into.numel(), dtype)
        return _Widen(self.swap.read(self.key(m), stage, start * stage.element_size()), stage, into, post)

    def total_squares(self) -> torch.Tensor:
        """Sum of squares of every gradient written since `clear` (float64 [1]; inf/nan if any is)."""
        out = torch.zeros(1, dtype=torch.float64)
        for sq in self.squares.values():
            out += sq.to(out.device)
        return out

    def nonfinite(self) -> list[int]:
        """Masters whose gradient has inf/nan."""
        return [m for m, sq in self.squares.items() if not bool(torch.isfinite(sq).all())]

    def scale_(self, factor) -> None:
        """Multiply every gradient by `factor` (applied lazily: `apply_scales` when the step reads)."""
        self.scales.append(factor)

    def apply_scales(self, grad: torch.Tensor) -> torch.Tensor:
        for f in self.scales:
            grad.mul_(f.to(grad.device) if torch.is_tensor(f) else f)
        return grad

    def inflight_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for _, g in self.writes.values())

    def drain(self) -> None:
        """Wait for every write."""
        for m in list(self.writes):
            self._wait(m)

    def clear(self, keep: frozenset = frozenset()) -> None:
        """Forget this step's gradients (the files stay, to be overwritten): zero_grad. keep: masters whose
        gradient is still to be read by a deferred step (`read_rows` still converts it; `has` is False)."""
        self.drain()
        self.squares.clear()
        self.low = {m: v for m, v in self.low.items() if m in keep}
        self.scales.clear()
        self.consumed.clear()
        self.consumer = None

    def _wait(self, m: int) -> None:
        entry = self.writes.pop(m, None)
        if entry is not None:
            entry[0].wait()


def widen_into(into: torch.Tensor, low: torch.Tensor, post: float) -> torch.Tensor:
    """A reduced 2-byte gradient `low` as its fp32 accumulator value, written into `into` (its shape):
    float(low) x (1 / post). The one definition of that arithmetic (in memory and on NVMe alike)."""
    into.copy_(low)
    return into.mul_(1.0 / post)


class _Widen:
    """A read of a 2-byte gradient into `stage`; wait() converts it into the fp32 `into`, times 1/post
    (`ShardedUnit.materialize_grad`'s operations)."""

    def __init__(self, handle: IOHandle, stage: torch.Tensor, into: torch.Tensor, post: float):
        self.handle, self.stage, self.into, self.post = handle, stage, into, post

    def done(self) -> bool:
        """The read finished (wait() then only converts)."""
        return self.stage is None or self.handle.done()

    def wait(self) -> None:
        if self.stage is not None:
            self.handle.wait()
            widen_into(self.into, self.stage, self.post)
            self.stage = None
