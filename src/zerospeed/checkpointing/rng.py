"""Named RNG streams for model-parallel regions (Megatron/DeepSpeed `get_cuda_rng_tracker`).

The tracker keeps extra generator states under names. `fork(name)` swaps the device's default
generator to that stream for the duration of a block (dropout inside a tensor-parallel region
must differ across tensor-parallel ranks but agree across data-parallel ranks) and puts the
original state back afterwards. The "device" is the current accelerator when one is available
(torch.accelerator), otherwise the host generator, matching DeepSpeed's accelerator abstraction.

Activation checkpointing (`zerospeed.checkpointing.checkpoint`) saves the tracker's states at
forward time and restores them while recomputing, so dropout under `fork()` inside a
checkpointed region draws the same mask twice.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_SEED_OFFSET = 2718  # DeepSpeed/Megatron offset between the data- and model-parallel seeds


def _device_module() -> Any | None:
    """torch.<accelerator> module when an accelerator is available, else None (host RNG)."""
    if torch.accelerator.is_available():
        return torch.get_device_module(torch.accelerator.current_accelerator())
    return None


def get_device_rng_state() -> torch.Tensor:
    """State of the default generator of the current accelerator (host generator without one)."""
    mod = _device_module()
    return mod.get_rng_state() if mod is not None else torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    """Restore a state returned by `get_device_rng_state()`."""
    mod = _device_module()
    if mod is not None:
        mod.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _device_manual_seed(seed: int) -> None:
    mod = _device_module()
    if mod is not None:
        mod.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states for the current device (DeepSpeed's `CudaRNGStatesTracker`).

    add(name, seed) creates a stream; fork(name) runs a block on it; get_states()/set_states()
    snapshot and restore all streams (used by activation checkpointing). Errors: adding a name or
    seed twice, or forking an unknown name, raises ValueError (DeepSpeed raises bare Exception).
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every stream."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A shallow copy of {name: generator state}; safe to keep across later forks."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace all streams by a snapshot from get_states()."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed` without disturbing the current generator.

        Raises ValueError if the name or the seed is already used.
        """
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already used by another RNG stream; pick a different seed")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists; call reset() first to re-seed it")
        original = get_device_rng_state()
        try:
            _device_manual_seed(seed)
            self.states_[name] = get_device_rng_state()
        finally:
            set_device_rng_state(original)
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block on stream `name`, then store its advanced state and restore the
        original generator. Raises ValueError if `name` was never added."""
        if name not in self.states_:
            raise ValueError(f"RNG stream {name!r} is not added; known: {sorted(self.states_)}. "
                             "Call get_rng_tracker().add(name, seed) or model_parallel_seed(seed) first")
        original = get_device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state()
            set_device_rng_state(original)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (DeepSpeed: `deepspeed.checkpointing.get_cuda_rng_tracker()`)."""
    return _TRACKER


def model_parallel_seed(seed: int, *, tp_rank: int = 0) -> tuple[int, int]:
    """Seed the default generators and the model-parallel stream (DeepSpeed's
    `model_parallel_cuda_manual_seed`).

    The default generators (host and every device, via torch.manual_seed) get `seed`, shared by
    the data-parallel replicas; stream "model-parallel-rng" gets `seed + 2718 + tp_rank`, distinct
    per tensor-parallel rank. The tracker is reset first. Returns (data_parallel_seed,
    model_parallel_seed). Raises ValueError for a negative tp_rank.
    """
    if tp_rank < 0:
        raise ValueError(f"tp_rank must be >= 0, got {tp_rank}")
    mp_seed = seed + _SEED_OFFSET + tp_rank
    _TRACKER.reset()
    torch.manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, mp_seed)
    return seed, mp_seed
