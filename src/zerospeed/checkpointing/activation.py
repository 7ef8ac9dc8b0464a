"""Activation checkpointing with DeepSpeed's `deepspeed.checkpointing` surface.

Built on `torch.utils.checkpoint.checkpoint(use_reentrant=False)`: a checkpointed region keeps
only its inputs during forward and recomputes its activations during backward. Torch restores
the host and device RNG states for the recomputation (dropout draws the same mask), and we also
restore the named streams of `get_rng_tracker()`.

Settings (`configure(...)` argument, then the `activation_checkpointing` key of a ds_config):

- partition_activations (partition_activations): no-op without model parallelism (a one-rank
  partition is the whole tensor, as in DeepSpeed); NotImplementedError when the mpu reports a
  model-parallel group of more than one rank.
- checkpoint_in_cpu (cpu_checkpointing): checkpointed inputs live in host memory between
  forward and backward, via `torch.autograd.graph.save_on_cpu`.
- contiguous_checkpointing (contiguous_memory_optimization): validated as in DeepSpeed (needs
  partition_activations and number_checkpoints), otherwise a no-op: the caching allocator
  already reuses the blocks.
- num_checkpoints (number_checkpoints): validated (positive int); only used by the above.
- synchronize (synchronize_checkpoint_boundary): accelerator synchronize around each region.
- profile (profile): wall time of each region and of its recomputation, see
  `get_profile_stats()`; the regions also show in torch.profiler as "zerospeed::checkpoint" and
  "zerospeed::checkpoint_recompute".
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .rng import get_rng_tracker, model_parallel_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointingSettings:
    """The `activation_checkpointing` block, DeepSpeed's keys and defaults (see module doc)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


_VALID_KEYS = tuple(f.name for f in dataclasses.fields(CheckpointingSettings))
_settings = CheckpointingSettings()
_configured = False
_mpu: Any = None
_stats = {"calls": 0, "forward_seconds": 0.0, "recomputes": 0, "recompute_seconds": 0.0}


def _closest(key: str, valid: Iterable[str]) -> str:
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.0)
    return match[0] if match else ""


def validate_activation_checkpointing(block: Mapping[str, Any]) -> CheckpointingSettings:
    """Check an `activation_checkpointing` block and return its settings.

    Raises ValueError for an unknown key (naming the closest valid one), a non-bool flag or a
    number_checkpoints that is not a positive int.
    """
    if not isinstance(block, Mapping):
        raise ValueError(f"activation_checkpointing must be a JSON object, got {type(block).__name__}")
    for key, value in block.items():
        if key not in _VALID_KEYS:
            raise ValueError(f"unknown activation_checkpointing key {key!r}; did you mean "
                             f"{_closest(key, _VALID_KEYS)!r}? Valid keys: {', '.join(_VALID_KEYS)}")
        if key == "number_checkpoints":
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"activation_checkpointing.number_checkpoints must be a positive int or null, "
                                 f"got {value!r}")
        elif not isinstance(value, bool):
            raise ValueError(f"activation_checkpointing.{key} must be true or false, got {value!r}")
    return CheckpointingSettings(**dict(block))


def _load_block(deepspeed_config: Any) -> dict[str, Any]:
    """The activation_checkpointing block of a ds_config path, dict or config object."""
    cfg = deepspeed_config
    if isinstance(cfg, (str, os.PathLike)):
        with open(cfg) as f:
            cfg = json.load(f)
    if isinstance(cfg, Mapping):
        block = cfg.get("activation_checkpointing") or {}
    else:  # a parsed config object (e.g. a pydantic model) with an activation_checkpointing field
        block = getattr(cfg, "activation_checkpointing", None) or {}
    if hasattr(block, "model_dump"):
        block = block.model_dump()
    elif dataclasses.is_dataclass(block):
        block = dataclasses.asdict(block)
    return dict(block) if isinstance(block, Mapping) else block


def _mp_world_size(mpu: Any) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        fn = getattr(mpu, name, None)
        if callable(fn):
            return int(fn())
    return 1


def _mp_rank(mpu: Any) -> int:
    for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank"):
        fn = getattr(mpu, name, None)
        if callable(fn):
            return int(fn())
    return 0


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> CheckpointingSettings:
    """Configure activation checkpointing (DeepSpeed's `deepspeed.checkpointing.configure`).

    Starts from the defaults, applies the `activation_checkpointing` block of `deepspeed_config`
    (a JSON path, a dict holding the whole ds_config, or a config object with that attribute),
    then the explicit arguments, which win. mpu_: optional model-parallel unit exposing
    get_(tensor_)model_parallel_world_size()/rank(). Returns the settings now in force.

    Raises ValueError for an unknown or mistyped key, or for contiguous_memory_optimization
    without partition_activations or without number_checkpoints (DeepSpeed asserts the same);
    NotImplementedError for partition_activations with a model-parallel group of more than one
    rank (splitting checkpoints across ranks is not implemented; with one rank it is a no-op).
    """
    global _settings, _configured, _mpu
    merged: dict[str, Any] = dataclasses.asdict(CheckpointingSettings())
    if deepspeed_config is not None:
        merged.update(dataclasses.asdict(validate_activation_checkpointing(_load_block(deepspeed_config))))
    explicit = {"partition_activations": partition_activations, "contiguous_memory_optimization":
                contiguous_checkpointing, "number_checkpoints": num_checkpoints, "cpu_checkpointing":
                checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    merged.update({k: v for k, v in explicit.items() if v is not None})
    settings = validate_activation_checkpointing(merged)
    if settings.contiguous_memory_optimization and not settings.partition_activations:
        raise ValueError("contiguous_memory_optimization needs partition_activations=true (as in DeepSpeed)")
    if settings.contiguous_memory_optimization and settings.number_checkpoints is None:
        raise ValueError("contiguous_memory_optimization needs number_checkpoints (the number of checkpointed "
                         "layers) to size its buffers")
    mp = _mp_world_size(mpu_) if mpu_ is not None else 1
    if settings.partition_activations and mp > 1:
        raise NotImplementedError(
            f"partition_activations=true would split each checkpoint across the {mp}-rank model-parallel group; "
            "zerospeed does not implement that. Set partition_activations to false (each rank keeps whole "
            "checkpoints) or use cpu_checkpointing to move them to host memory")
    if settings.partition_activations:
        logger.info("partition_activations has no effect without model parallelism (1-rank partition)")
    _settings, _configured, _mpu = settings, True, mpu_
    return settings


def is_configured() -> bool:
    """True once configure() has been called (DeepSpeed's `is_configured`)."""
    return _configured


def get_settings() -> CheckpointingSettings:
    """The settings in force (defaults until configure() is called)."""
    return _settings


def reset(*, unconfigure: bool = False) -> None:
    """Clear per-run state (DeepSpeed frees its contiguous buffers here; we clear the profile
    counters). unconfigure=True also returns to the defaults and is_configured() == False."""
    global _settings, _configured, _mpu
    _stats.update(calls=0, forward_seconds=0.0, recomputes=0, recompute_seconds=0.0)
    if unconfigure:
        _settings, _configured, _mpu = CheckpointingSettings(), False, None


def get_profile_stats() -> dict[str, float]:
    """With profile=true: {"calls", "forward_seconds", "recomputes", "recompute_seconds"} since
    the last reset(); times are wall seconds of checkpointed forwards and their recomputations."""
    return dict(_stats)


def model_parallel_cuda_manual_seed(seed: int) -> tuple[int, int]:
    """DeepSpeed's name for `model_parallel_seed(seed, tp_rank=<rank in the configured mpu>)`."""
    return model_parallel_seed(seed, tp_rank=_mp_rank(_mpu) if _mpu is not None else 0)


def _sync() -> None:
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


@contextlib.contextmanager
def _recompute_context(tracker_states: dict[str, torch.Tensor], timed: bool) -> Iterator[None]:
    tracker = get_rng_tracker()
    current = tracker.get_states()
    tracker.set_states(tracker_states)
    t0 = time.perf_counter()
    try:
        with torch.profiler.record_function("zerospeed::checkpoint_recompute"):
            yield
    finally:
        tracker.set_states(current)
        if timed:
            _sync()
            _stats["recomputes"] += 1
            _stats["recompute_seconds"] += time.perf_counter() - t0


def _offload_context() -> contextlib.AbstractContextManager:
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        return torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=acc.type)
    return torch.autograd.graph.save_on_cpu(pin_memory=False)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` keeping only its inputs for backward (DeepSpeed's
    `deepspeed.checkpointing.checkpoint(function, *args)`).

    Arguments may be tensors or any other objects; outputs are returned as `function` returns
    them. Activations are recomputed during backward with the RNG states of this call (host,
    device and the tracker's named streams), so outputs and gradients equal an uncheckpointed run.
    Honours the configured cpu_checkpointing, synchronize_checkpoint_boundary and profile.
    Under torch.no_grad() it simply calls `function`.
    """
    s = _settings
    fn = functools.partial(function, **kwargs) if kwargs else function

    def context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _recompute_context(get_rng_tracker().get_states(), s.profile)

    if s.synchronize_checkpoint_boundary or s.profile:
        _sync()
    t0 = time.perf_counter()
    offload = _offload_context() if s.cpu_checkpointing else contextlib.nullcontext()
    with torch.profiler.record_function("zerospeed::checkpoint"), offload:
        out = _torch_checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
    if s.synchronize_checkpoint_boundary or s.profile:
        _sync()
    if s.profile:
        _stats["calls"] += 1
        _stats["forward_seconds"] += time.perf_counter() - t0
    return out


non_reentrant_checkpoint = checkpoint


class _CheckpointedForward:
    """Instance-level `forward` that runs the original forward under `checkpoint`."""

    __slots__ = ("inner", "previous")

    def __init__(self, inner: Callable[..., Any], previous: Any) -> None:
        self.inner = inner          # the forward being checkpointed (a bound method)
        self.previous = previous    # instance-level forward found before wrapping, or None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.inner, *args, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """True if checkpoint_modules() wrapped this module's forward."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def checkpoint_modules(model: nn.Module, module_classes: Iterable[type] | type = (), *,
                       names: Iterable[str] | str | None = None,
                       predicate: Callable[[str, nn.Module], bool] | None = None) -> list[str]:
    """Checkpoint every matching submodule of an unmodified model, in place; returns their names.

    A submodule matches if it is an instance of one of `module_classes`, or its fully qualified
    name matches one of `names` (exact or fnmatch patterns such as "blocks.*"), or
    `predicate(name, module)` is true. Each match's forward is replaced by one that runs it under
    `checkpoint`; parameter names, state_dict keys and types are unchanged. Descendants of a match
    are not wrapped again. Calling it twice is harmless (already wrapped modules are kept and
    listed). The module's own forward hooks run once, outside the checkpointed region; hooks of
    its submodules run again during recomputation. Undo with remove_checkpointing(model).
    Raises ValueError if no selector is given or nothing matches.
    """
    classes = (module_classes,) if isinstance(module_classes, type) else tuple(module_classes)
    patterns = [names] if isinstance(names, str) else list(names or [])
    if not classes and not patterns and predicate is None:
        raise ValueError("give module_classes, names or predicate to choose the modules to checkpoint")
    chosen: list[str] = []
    for fqn, module in model.named_modules():
        if any(fqn.startswith(c + ".") or c == "" for c in chosen):
            continue
        hit = (bool(classes) and isinstance(module, classes)) or any(fnmatchcase(fqn, p) for p in patterns) \
            or (predicate is not None and predicate(fqn, module))
        if not hit:
            continue
        chosen.append(fqn)
        if not is_checkpointed(module):
            previous = module.__dict__.get("forward")
            module.forward = _CheckpointedForward(module.forward, previous)
    if not chosen:
        sample = [n for n, _ in model.named_modules()][:8]
        raise ValueError(f"no submodule matched module_classes={[c.__name__ for c in classes]}, names={patterns}, "
                         f"predicate={predicate}; module names look like {sample}")
    return chosen


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo checkpoint_modules() on every submodule of `model`; returns the names restored."""
    restored = []
    for fqn, module in model.named_modules():
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, _CheckpointedForward):
            if wrapper.previous is None:
                del module.__dict__["forward"]
            else:
                module.forward = wrapper.previous
            restored.append(fqn)
    return restored
